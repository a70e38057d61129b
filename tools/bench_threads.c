/*
 * bench_threads.c — multi-threaded allocation throughput: libkvalloc (one pool shared by every
 * thread) against glibc malloc, jemalloc, mimalloc and tcmalloc, at 1, 2 and 4 x nproc threads.
 *
 *     bench_threads [--quick] [--only NAME[,NAME...]] [--threads N[,N...]]
 *                   [--patterns P[,P...]] [--processes N] [--ms N] [--json FILE]
 *
 * The method is bench_alloc's (bench_protocol.h): this process measures nothing; it starts one
 * child per (allocator, pattern, thread count, repetition),
 *     bench_threads --child NAME --pattern P --threads T --ms D --warmup-ms W
 * with the peer allocator in LD_PRELOAD (glibc and libkvalloc: no preload), the child checks
 * that the preload took effect, and reports on stdout in bench_protocol.h's line format. Every
 * figure is the median over the processes, which run in turns across the allocators.
 *
 * Patterns (objects are never written, as in bench_alloc; libkvalloc's memory may be a GPU's):
 *   batch64   every thread: rounds of 1,000 allocations of 64 B, then 1,000 frees in the same
 *             order
 *   batch4k   the same with 4 KiB
 *   prodcons  threads in pairs: the producer allocates 64 B objects and passes them through a
 *             bounded single-producer/single-consumer ring (C11 atomics) to its consumer, which
 *             frees them: every free is of an object another thread allocated. Needs an even
 *             thread count.
 *
 * One op is one allocation or one free; a process's figure is
 *     ops/s = (allocations + frees of all threads) / (last thread's end - barrier release),
 * so a 1-thread batch figure is 1e9 / bench_alloc's ns/op of the same pattern. In a child the
 * threads first run a warm-up phase (caches and slabs come into being), then the measured one:
 * all threads wait on one barrier, the main thread sleeps D ms after the release and raises a
 * stop flag, which the threads read once per round (batches) or per 64 objects (producers).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_clock.h"
#include "bench_host.h"
#include "bench_protocol.h"
#include "kvalloc.h"

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

#define BATCH_OBJECTS 1000
#define PC_OBJECT 64
#define RING_SLOTS 1024 /* a power of two */
#define POOL_CAPACITY GIB

#define MAX_THREADS 1024
#define MAX_THREAD_COUNTS 8
#define MAX_PROCESSES 101

enum pattern { PAT_BATCH64, PAT_BATCH4K, PAT_PRODCONS, PAT_COUNT };

static const struct {
    const char *key;   /* option and JSON name */
    const char *label; /* table label */
} patterns[PAT_COUNT] = {
    [PAT_BATCH64] = {"batch64", "64 B batch"},
    [PAT_BATCH4K] = {"batch4k", "4 KiB batch"},
    [PAT_PRODCONS] = {"prodcons", "producer/consumer 64 B"},
};

/* The figures a child reports (bench_protocol.h's line format, metric names of this tool). */
#define METRIC_OPS_PER_S "ops_per_s"
#define METRIC_OPS "ops"
#define METRIC_ELAPSED_NS "elapsed_ns"

static int find_pattern(const char *key)
{
    for (int p = 0; p < PAT_COUNT; p++)
        if (strcmp(key, patterns[p].key) == 0)
            return p;
    return -1;
}

/* ======================================================================================== */
/* The child: one allocator, one pattern, one thread count, in a process of its own          */
/* ======================================================================================== */

/* The single-producer/single-consumer ring of one pair. head is written by the consumer only,
 * tail by the producer only, each on a line of its own. Each side publishes its index every
 * RING_PUBLISH slots, and before it waits (so neither can wait on slots the other has taken but
 * not yet published), and keeps a private copy of the other's index, reloaded only when the
 * ring looks full (or empty): the ring's own cost is a few cache-line transfers per
 * RING_PUBLISH objects, small beside the allocator's. */
#define RING_PUBLISH 32 /* divides RING_SLOTS */

struct ring {
    _Alignas(64) _Atomic uint64_t head;
    _Alignas(64) _Atomic uint64_t tail;
    _Alignas(64) _Atomic int done; /* set by the producer after its last push of the phase */
    _Alignas(64) void *slot[RING_SLOTS];
};

struct worker {
    pthread_t thread;
    const struct backend *b;
    enum pattern pattern;
    int producer; /* prodcons: producer (1) or consumer (0) of ring */
    struct ring *ring;
    uint64_t index;     /* prodcons: this side's own index (tail or head) */
    uint64_t published; /* prodcons: the value of index last stored to the ring */
    uint64_t other;     /* prodcons: its last reading of the other side's index */
    void **slots;       /* batches: the live objects of a round */
    /* Results of the current phase, read by the main thread after the end barrier. */
    uint64_t ops;
    double start_ns, end_ns;
} __attribute__((aligned(64)));

static struct {
    pthread_barrier_t start, end;
    unsigned phases;
    _Alignas(64) _Atomic int stop;
} g_run;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

/* Waiting on the other side of a ring: spin a little (both threads on cores of their own),
 * then yield the CPU (more threads than cores: the other side may be waiting for it). */
static inline void backoff(unsigned *spins)
{
    if (++*spins < 64)
        cpu_relax();
    else
        sched_yield();
}

static int stop_requested(void) { return atomic_load_explicit(&g_run.stop, memory_order_relaxed); }

static void batch_phase(struct worker *w, size_t size)
{
    uint64_t rounds = 0;
    do {
        for (int i = 0; i < BATCH_OBJECTS; i++)
            if (bench_alloc_into(w->b, size, &w->slots[i]))
                bench_die("allocation of %zu bytes failed", size);
        int refused = 0;
        for (int i = 0; i < BATCH_OBJECTS; i++)
            refused |= bench_release(w->b, w->slots[i]);
        if (refused)
            bench_die("a free of a %zu-byte object was refused", size);
        rounds++;
    } while (!stop_requested());
    w->end_ns = bench_now_ns();
    w->ops = rounds * 2 * BATCH_OBJECTS;
}

/* Stores this side's index where the other side reads it (tail for the producer, head for the
 * consumer). */
static void publish(struct worker *w, _Atomic uint64_t *where)
{
    if (w->published != w->index) {
        atomic_store_explicit(where, w->index, memory_order_release);
        w->published = w->index;
    }
}

static void producer_phase(struct worker *w)
{
    struct ring *r = w->ring;
    uint64_t made = 0;
    while ((made & 63) != 0 || !stop_requested()) {
        void *p;
        if (bench_alloc_into(w->b, PC_OBJECT, &p))
            bench_die("allocation of %d bytes failed", PC_OBJECT);
        if (w->index - w->other == RING_SLOTS) {
            unsigned spins = 0;
            publish(w, &r->tail);
            while (w->index - (w->other = atomic_load_explicit(&r->head, memory_order_acquire)) ==
                   RING_SLOTS)
                backoff(&spins);
        }
        r->slot[w->index & (RING_SLOTS - 1)] = p;
        if (++w->index % RING_PUBLISH == 0)
            publish(w, &r->tail);
        made++;
    }
    publish(w, &r->tail);
    atomic_store_explicit(&r->done, 1, memory_order_release);
    w->end_ns = bench_now_ns();
    w->ops = made;
}

/* Takes the next object off the ring; 0 if it is empty. */
static int ring_pop(struct worker *w, void **p)
{
    struct ring *r = w->ring;
    if (w->index == w->other) {
        publish(w, &r->head);
        w->other = atomic_load_explicit(&r->tail, memory_order_acquire);
        if (w->index == w->other)
            return 0;
    }
    *p = r->slot[w->index & (RING_SLOTS - 1)];
    if (++w->index % RING_PUBLISH == 0)
        publish(w, &r->head);
    return 1;
}

static void consumer_phase(struct worker *w)
{
    uint64_t freed = 0;
    unsigned spins = 0;
    for (;;) {
        void *p;
        if (ring_pop(w, &p)) {
            if (bench_release(w->b, p))
                bench_die("a free of a %d-byte object from another thread was refused", PC_OBJECT);
            freed++;
            spins = 0;
        } else if (atomic_load_explicit(&w->ring->done, memory_order_acquire)) {
            /* Everything pushed before done is visible now: drain it, then stop. */
            if (w->index == atomic_load_explicit(&w->ring->tail, memory_order_acquire))
                break;
        } else {
            backoff(&spins);
        }
    }
    w->end_ns = bench_now_ns();
    w->ops = freed;
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    for (unsigned phase = 0; phase < g_run.phases; phase++) {
        pthread_barrier_wait(&g_run.start);
        w->start_ns = bench_now_ns();
        if (w->pattern == PAT_BATCH64)
            batch_phase(w, 64);
        else if (w->pattern == PAT_BATCH4K)
            batch_phase(w, 4096);
        else if (w->producer)
            producer_phase(w);
        else
            consumer_phase(w);
        pthread_barrier_wait(&g_run.end);
    }
    return NULL;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static int child_main(int argc, char **argv)
{
    enum bench_allocator allocator = BENCH_ALLOCATOR_COUNT;
    int pattern = -1;
    unsigned threads = 0, ms = 200, warmup_ms = 50;
    static char tool[64];
    for (int i = 1; i < argc; i += 2) {
        const char *flag = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (value == NULL)
            bench_die("%s wants a value", flag);
        if (strcmp(flag, "--child") == 0) {
            for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
                if (strcmp(value, bench_allocators[a].name) == 0)
                    allocator = (enum bench_allocator)a;
            if (allocator == BENCH_ALLOCATOR_COUNT)
                bench_die("unknown allocator '%s'", value);
            snprintf(tool, sizeof tool, "bench_threads --child %s", value);
            bench_set_identity(tool, 2);
        } else if (strcmp(flag, "--pattern") == 0) {
            if ((pattern = find_pattern(value)) < 0)
                bench_die("unknown pattern '%s' (batch64, batch4k, prodcons)", value);
        } else if (strcmp(flag, "--threads") == 0) {
            threads = bench_parse_count(flag, value, MAX_THREADS);
        } else if (strcmp(flag, "--ms") == 0) {
            ms = bench_parse_count(flag, value, 600000);
        } else if (strcmp(flag, "--warmup-ms") == 0) {
            warmup_ms = bench_parse_count(flag, value, 600000);
        } else {
            bench_die("unknown option %s", flag);
        }
    }
    if (allocator == BENCH_ALLOCATOR_COUNT || pattern < 0 || threads == 0)
        bench_die("--child, --pattern and --threads are required");
    if (pattern == PAT_PRODCONS && threads % 2 != 0)
        bench_die("prodcons runs threads in pairs: %u threads is odd", threads);
    bench_verify_allocator(allocator);

    const struct backend *b = &bench_malloc_backend;
    if (allocator == BENCH_KVALLOC) {
        /* One pool for all threads, default arenas; named like bench_alloc's, so it publishes
         * its statistics from its slow paths as an engine's pool would. */
        kva_config cfg;
        kva_config_init(&cfg);
        cfg.capacity = POOL_CAPACITY;
        cfg.name = "bench_threads";
        kva_status st = kva_pool_create(&cfg, &bench_pool);
        if (st != KVA_OK)
            bench_die("kva_pool_create(%zu MiB): %s: %s", POOL_CAPACITY / MIB, kva_strerror(st),
                      kva_last_error());
        b = &bench_kvalloc_backend;
    }

    /* Bookkeeping comes from the allocator under test too (malloc is preloaded), but before
     * the first barrier. */
    struct worker *workers = bench_xcalloc(threads, sizeof *workers);
    size_t pairs = pattern == PAT_PRODCONS ? threads / 2 : 0;
    struct ring *rings = NULL;
    if (pairs > 0 && posix_memalign((void **)&rings, 64, pairs * sizeof *rings) != 0)
        bench_die("out of memory for the rings");
    for (size_t p = 0; p < pairs; p++) {
        atomic_init(&rings[p].head, 0);
        atomic_init(&rings[p].tail, 0);
        atomic_init(&rings[p].done, 0);
    }
    g_run.phases = 2; /* warm-up, then measured */
    atomic_init(&g_run.stop, 0);
    if (pthread_barrier_init(&g_run.start, NULL, threads + 1) != 0 ||
        pthread_barrier_init(&g_run.end, NULL, threads + 1) != 0)
        bench_die("pthread_barrier_init failed");
    for (unsigned t = 0; t < threads; t++) {
        struct worker *w = &workers[t];
        w->b = b;
        w->pattern = (enum pattern)pattern;
        if (pattern == PAT_PRODCONS) {
            w->ring = &rings[t / 2];
            w->producer = t % 2 == 0;
        } else {
            w->slots = bench_xcalloc(BATCH_OBJECTS, sizeof *w->slots);
        }
        int err = pthread_create(&w->thread, NULL, worker_main, w);
        if (err != 0)
            bench_die("pthread_create: %s", strerror(err));
    }

    double ops = 0, elapsed = 0;
    for (unsigned phase = 0; phase < g_run.phases; phase++) {
        /* Every worker is at (or on its way to) the start barrier: none reads these now. */
        atomic_store_explicit(&g_run.stop, 0, memory_order_relaxed);
        for (size_t p = 0; p < pairs; p++)
            atomic_store_explicit(&rings[p].done, 0, memory_order_relaxed);
        pthread_barrier_wait(&g_run.start);
        double released = bench_now_ns();
        sleep_ms(phase == 0 ? warmup_ms : ms);
        atomic_store_explicit(&g_run.stop, 1, memory_order_relaxed);
        pthread_barrier_wait(&g_run.end);
        /* The release is the earliest clock read after the barrier, whichever thread made it. */
        double first = released, last = 0;
        ops = 0;
        for (unsigned t = 0; t < threads; t++) {
            first = workers[t].start_ns < first ? workers[t].start_ns : first;
            last = workers[t].end_ns > last ? workers[t].end_ns : last;
            ops += (double)workers[t].ops;
        }
        elapsed = last - first;
        for (size_t p = 0; p < pairs; p++)
            if (workers[2 * p].ops != workers[2 * p + 1].ops)
                bench_die("pair %zu: %llu objects produced but %llu freed", p,
                          (unsigned long long)workers[2 * p].ops,
                          (unsigned long long)workers[2 * p + 1].ops);
    }
    for (unsigned t = 0; t < threads; t++) {
        pthread_join(workers[t].thread, NULL);
        free(workers[t].slots);
    }
    if (bench_pool != NULL) {
        /* Every object was freed and every thread has exited: the pool must be whole. */
        kva_status st = kva_check(bench_pool);
        if (st != KVA_OK)
            bench_die("kva_check after the run: %s: %s", kva_strerror(st), kva_last_error());
        kva_pool_destroy(bench_pool);
    }
    const char *name = bench_allocators[allocator].name;
    bench_report(name, METRIC_OPS_PER_S, ops / elapsed * 1e9);
    bench_report(name, METRIC_OPS, ops);
    bench_report(name, METRIC_ELAPSED_NS, elapsed);
    free(rings);
    free(workers);
    pthread_barrier_destroy(&g_run.start);
    pthread_barrier_destroy(&g_run.end);
    return fflush(stdout) == 0 ? 0 : 2;
}

/* ======================================================================================== */
/* The parent                                                                                */
/* ======================================================================================== */

struct settings {
    int quick;
    unsigned processes; /* fresh child processes per figure, median taken here */
    unsigned ms;        /* measured phase of a child */
    unsigned warmup_ms; /* warm-up phase of a child */
    unsigned threads[MAX_THREAD_COUNTS];
    unsigned thread_counts;
    int pattern_on[PAT_COUNT];
    int selected[BENCH_ALLOCATOR_COUNT];
    const char *json_path;
};

struct machine {
    char cpu[128];
    long cores;  /* online */
    long usable; /* in this process's affinity mask: what nproc prints */
    char kernel[128];
    /* CPU time others took while the children ran, as average cores (NAN if unknown): other
     * processes (user, system, interrupts, less the children's and this process's own time)
     * and the hypervisor (steal). Whatever else runs takes cores from the threads measured. */
    double others_cores, steal_cores;
};

struct reports {
    double value[MAX_PROCESSES];
    unsigned count;
};

static struct allocator_state g_alloc[BENCH_ALLOCATOR_COUNT];
static struct reports g_ops[BENCH_ALLOCATOR_COUNT][PAT_COUNT][MAX_THREAD_COUNTS];

static void usage(FILE *to)
{
    fputs("usage: bench_threads [--quick] [--only NAME[,NAME...]] [--threads N[,N...]]\n"
          "                     [--patterns P[,P...]] [--processes N] [--ms N] [--json FILE]\n"
          "allocators: glibc jemalloc mimalloc tcmalloc kvalloc\n"
          "patterns: batch64 batch4k prodcons; threads: default 1,2,4*nproc\n",
          to);
}

/* Copies a comma-separated option value into copy, for strtok_r. */
static char *list_copy(const char *list, char *copy, size_t size)
{
    if (strlen(list) >= size)
        bench_die("list too long: %s", list);
    return strcpy(copy, list);
}

static void add_thread_count(struct settings *s, unsigned t)
{
    for (unsigned i = 0; i < s->thread_counts; i++)
        if (s->threads[i] == t)
            return;
    if (s->thread_counts == MAX_THREAD_COUNTS)
        bench_die("at most %d thread counts", MAX_THREAD_COUNTS);
    unsigned i = s->thread_counts++;
    for (; i > 0 && s->threads[i - 1] > t; i--)
        s->threads[i] = s->threads[i - 1];
    s->threads[i] = t;
}

static void parse_options(int argc, char **argv, struct settings *s)
{
    const char *threads = NULL;
    char copy[256];
    unsigned processes = 0, ms = 0;
    *s = (struct settings){0};
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
        s->selected[a] = 1;
    for (int p = 0; p < PAT_COUNT; p++)
        s->pattern_on[p] = 1;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        int has_value = i + 1 < argc;
        if (strcmp(arg, "--quick") == 0) {
            s->quick = 1;
        } else if (strcmp(arg, "--only") == 0 && has_value) {
            bench_select_allocators(argv[++i], s->selected);
        } else if (strcmp(arg, "--patterns") == 0 && has_value) {
            memset(s->pattern_on, 0, sizeof s->pattern_on);
            char *save = NULL, *list = list_copy(argv[++i], copy, sizeof copy);
            for (char *name = strtok_r(list, ",", &save); name != NULL;
                 name = strtok_r(NULL, ",", &save)) {
                int p = find_pattern(name);
                if (p < 0)
                    bench_die("unknown pattern '%s' (batch64 batch4k prodcons)", name);
                s->pattern_on[p] = 1;
            }
        } else if (strcmp(arg, "--threads") == 0 && has_value) {
            threads = argv[++i];
        } else if (strcmp(arg, "--processes") == 0 && has_value) {
            processes = bench_parse_count(arg, argv[++i], MAX_PROCESSES);
        } else if (strcmp(arg, "--ms") == 0 && has_value) {
            ms = bench_parse_count(arg, argv[++i], 600000);
        } else if (strcmp(arg, "--json") == 0 && has_value) {
            s->json_path = argv[++i];
        } else if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            usage(stdout);
            exit(0);
        } else {
            usage(stderr);
            exit(1);
        }
    }
    if (threads != NULL) {
        for (char *save = NULL, *t = strtok_r(list_copy(threads, copy, sizeof copy), ",", &save);
             t != NULL; t = strtok_r(NULL, ",", &save))
            add_thread_count(s, bench_parse_count("--threads", t, MAX_THREADS));
    } else {
        long n = bench_usable_cpus();
        add_thread_count(s, 1);
        add_thread_count(s, 2);
        add_thread_count(s, (unsigned)(4 * (n < MAX_THREADS / 4 ? n : MAX_THREADS / 4)));
    }
    /* The default run takes about a minute on a 2-core machine; --quick about ten seconds,
     * for smoke runs (3 processes of 40 ms each are too few for figures to quote). */
    s->processes = processes ? processes : s->quick ? 3 : 5;
    s->ms = ms ? ms : s->quick ? 40 : 200;
    s->warmup_ms = s->quick ? 10 : 50;
}

static double g_children_cpu_s; /* user + system time of every child, from wait4 */

static void describe_machine(struct machine *m)
{
    bench_describe_host(m->cpu, sizeof m->cpu, &m->cores, m->kernel, sizeof m->kernel);
    m->usable = bench_usable_cpus();
    m->others_cores = m->steal_cores = NAN;
}

/* A child's report (bench_report_fn): its ops/s is the figure, the rest is for a reader. */
static void keep_ops_per_s(void *ctx, const char *metric, double value)
{
    if (strcmp(metric, METRIC_OPS_PER_S) == 0)
        *(double *)ctx = value;
}

/* Runs one child to completion and stores its ops/s; any failure ends the run, since a partial
 * comparison would read as a complete one. */
static void run_child(const struct settings *s, enum bench_allocator a, int pattern, unsigned tidx)
{
    char threads[16], ms[16], warmup[16];
    snprintf(threads, sizeof threads, "%u", s->threads[tidx]);
    snprintf(ms, sizeof ms, "%u", s->ms);
    snprintf(warmup, sizeof warmup, "%u", s->warmup_ms);
    const char *argv[] = {bench_self_path(),
                          "--child",
                          bench_allocators[a].name,
                          "--pattern",
                          patterns[pattern].key,
                          "--threads",
                          threads,
                          "--ms",
                          ms,
                          "--warmup-ms",
                          warmup,
                          NULL};
    bench_progress("  running %-8s %-8s %4s threads   ", bench_allocators[a].name,
                   patterns[pattern].key, threads);
    double ops_per_s = NAN;
    struct rusage usage;
    int status = bench_run_child(a, &g_alloc[a], argv, keep_ops_per_s, &ops_per_s, &usage);
    g_children_cpu_s += bench_cpu_seconds(&usage);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char how[48];
        if (WIFSIGNALED(status))
            snprintf(how, sizeof how, "killed by signal %d", WTERMSIG(status));
        else
            snprintf(how, sizeof how, "exit status %d", WEXITSTATUS(status));
        bench_die("the %s child for %s at %s threads failed (%s); see its message above",
                  bench_allocators[a].name, patterns[pattern].key, threads, how);
    }
    if (isnan(ops_per_s) || ops_per_s <= 0)
        bench_die("the %s child for %s at %s threads reported no throughput",
                  bench_allocators[a].name, patterns[pattern].key, threads);
    struct reports *r = &g_ops[a][pattern][tidx];
    r->value[r->count++] = ops_per_s;
}

static int runs_at(int pattern, unsigned threads)
{
    return pattern != PAT_PRODCONS || threads % 2 == 0;
}

/* Every figure is the median over several processes, run in turns across the allocators so that
 * a slow spell of the machine is shared by all of them; the allocator that goes first changes
 * from one repetition to the next, so that no allocator always follows the same one. */
static void run_all(const struct settings *s)
{
    unsigned children = 0;
    for (unsigned rep = 0; rep < s->processes; rep++)
        for (int p = 0; p < PAT_COUNT; p++)
            for (unsigned t = 0; t < s->thread_counts; t++)
                for (int k = 0; k < BENCH_ALLOCATOR_COUNT; k++) {
                    int a = (int)((k + rep) % BENCH_ALLOCATOR_COUNT);
                    if (s->pattern_on[p] && g_alloc[a].measured && runs_at(p, s->threads[t])) {
                        run_child(s, (enum bench_allocator)a, p, t);
                        children++;
                    }
                }
    if (children == 0)
        bench_die("nothing to run: no allocator found, or producer/consumer alone at odd thread "
                  "counts");
    bench_progress_done();
}

/* The median of the processes' ops/s (the upper middle one for an even count); NAN if none. */
static double figure(int a, int pattern, unsigned tidx)
{
    struct reports r = g_ops[a][pattern][tidx];
    return r.count == 0 ? NAN : bench_median(r.value, r.count);
}

static int thread_index(const struct settings *s, unsigned threads)
{
    for (unsigned i = 0; i < s->thread_counts; i++)
        if (s->threads[i] == threads)
            return (int)i;
    return -1;
}

/* 2-thread over 1-thread throughput; NAN where either is missing. */
static double scaling(const struct settings *s, int a, int pattern)
{
    int one = thread_index(s, 1), two = thread_index(s, 2);
    if (one < 0 || two < 0)
        return NAN;
    return figure(a, pattern, (unsigned)two) / figure(a, pattern, (unsigned)one);
}

/* ---- targets ---------------------------------------------------------------------------- */

enum target_state { TARGET_NA, TARGET_PASS, TARGET_MISS };

struct target {
    char name[96];
    char key[48];
    enum target_state state;
    double value, reference, ratio;
    char detail[160];
};

#define MAX_TARGETS (2 + MAX_THREAD_COUNTS)

#define SCALING_TARGET 1.8

static unsigned judge_targets(const struct settings *s, const struct machine *m, struct target *t)
{
    unsigned n = 0;
    int one = thread_index(s, 1), two = thread_index(s, 2);
    for (int p = PAT_BATCH64; p <= PAT_BATCH4K; p++) {
        struct target *x = &t[n++];
        *x = (struct target){.state = TARGET_NA, .value = NAN, .reference = NAN, .ratio = NAN};
        snprintf(x->name, sizeof x->name, "%s: 2 threads >= %.1fx 1 thread", patterns[p].label,
                 SCALING_TARGET);
        snprintf(x->key, sizeof x->key, "%s_scaling_2_over_1", patterns[p].key);
        if (!s->pattern_on[p])
            snprintf(x->detail, sizeof x->detail, "n/a (pattern not run)");
        else if (one < 0 || two < 0)
            snprintf(x->detail, sizeof x->detail, "n/a (needs --threads with 1 and 2)");
        else if (!g_alloc[BENCH_KVALLOC].measured)
            snprintf(x->detail, sizeof x->detail, "n/a (kvalloc not measured)");
        else if (m->usable < 2)
            snprintf(x->detail, sizeof x->detail, "n/a (needs 2 cores; %ld usable)", m->usable);
        else {
            x->value = figure(BENCH_KVALLOC, p, (unsigned)two);
            x->reference = figure(BENCH_KVALLOC, p, (unsigned)one);
            x->ratio = x->value / x->reference;
            x->state = x->ratio >= SCALING_TARGET ? TARGET_PASS : TARGET_MISS;
            snprintf(x->detail, sizeof x->detail, "%.2fx (%.1f vs %.1f M ops/s)", x->ratio,
                     x->value / 1e6, x->reference / 1e6);
        }
    }
    for (unsigned i = 0; i < s->thread_counts && s->pattern_on[PAT_PRODCONS]; i++) {
        if (!runs_at(PAT_PRODCONS, s->threads[i]))
            continue;
        struct target *x = &t[n++];
        *x = (struct target){.state = TARGET_NA, .value = NAN, .reference = NAN, .ratio = NAN};
        snprintf(x->name, sizeof x->name, "producer/consumer >= tcmalloc, %u threads",
                 s->threads[i]);
        snprintf(x->key, sizeof x->key, "prodcons_vs_tcmalloc_%u_threads", s->threads[i]);
        x->value = figure(BENCH_KVALLOC, PAT_PRODCONS, i);
        x->reference = figure(BENCH_TCMALLOC, PAT_PRODCONS, i);
        if (isnan(x->value) || isnan(x->reference)) {
            snprintf(x->detail, sizeof x->detail, "n/a (%s not measured)",
                     isnan(x->value) ? "kvalloc" : "tcmalloc");
        } else {
            x->ratio = x->value / x->reference;
            x->state = x->ratio >= 1.0 ? TARGET_PASS : TARGET_MISS;
            snprintf(x->detail, sizeof x->detail, "%.2fx tcmalloc (%.1f vs %.1f M ops/s)", x->ratio,
                     x->value / 1e6, x->reference / 1e6);
        }
    }
    return n;
}

static const char *target_word(enum target_state st)
{
    return st == TARGET_PASS ? "PASS" : st == TARGET_MISS ? "MISS" : "-";
}

/* ---- the table -------------------------------------------------------------------------- */

#define COLUMN 17

static void print_header(const struct settings *s, const char *title)
{
    printf("%-34s", title);
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
        if (s->selected[a])
            printf("%*s", COLUMN, bench_allocators[a].name);
    printf("\n");
}

static void print_table(const struct settings *s, const struct machine *m, const struct target *t,
                        unsigned targets)
{
    printf("\nbench_threads: %s, %ld cores (%ld usable), Linux %s\n", m->cpu, m->cores, m->usable,
           m->kernel);
    if (!isnan(m->others_cores))
        printf("other load during the run: %.2f cores busy with other processes, %.2f stolen by "
               "the hypervisor%s\n",
               m->others_cores, m->steal_cores,
               m->others_cores + m->steal_cores >= 0.2 ? " (figures, scaling most, suffer)" : "");
    printf("median of %u processes per figure; in each, a %u ms warm-up, then %u ms from one "
           "barrier's release to the last thread's end\n",
           s->processes, s->warmup_ms, s->ms);
    printf("ops/s = (allocations + frees, all threads) / that interval, in millions; batch: "
           "rounds of %d allocs then %d frees per thread;\nproducer/consumer: thread pairs, "
           "%d B objects through a %d-slot SPSC ring (published every %d), freed by the other "
           "thread\n",
           BATCH_OBJECTS, BATCH_OBJECTS, PC_OBJECT, RING_SLOTS, RING_PUBLISH);
    printf("peers through malloc/free (LD_PRELOAD; tcmalloc = gperftools tcmalloc_minimal); "
           "kvalloc: one shared 1 GiB pool;\n(x) = kvalloc / peer, above 1 means kvalloc is "
           "faster; producer/consumer runs in pairs, so not at odd thread counts\n\n");
    print_header(s, "M ops/s");
    for (int p = 0; p < PAT_COUNT; p++) {
        if (!s->pattern_on[p])
            continue;
        for (unsigned i = 0; i < s->thread_counts; i++) {
            if (!runs_at(p, s->threads[i]))
                continue;
            char label[64];
            snprintf(label, sizeof label, "%s, %u thread%s", patterns[p].label, s->threads[i],
                     s->threads[i] == 1 ? "" : "s");
            printf("%-34s", label);
            double kva = figure(BENCH_KVALLOC, p, i);
            for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++) {
                if (!s->selected[a])
                    continue;
                char cell[48], value[32];
                double v = figure(a, p, i);
                bench_format_figure(value, sizeof value, v / 1e6); /* millions of ops/s */
                if (!g_alloc[a].measured)
                    snprintf(cell, sizeof cell, "skipped");
                else if (a != BENCH_KVALLOC && !isnan(v) && !isnan(kva))
                    snprintf(cell, sizeof cell, "%s (%.2fx)", value, kva / v);
                else
                    snprintf(cell, sizeof cell, "%s", value);
                printf("%*s", COLUMN, cell);
            }
            printf("\n");
        }
        if (p != PAT_PRODCONS && thread_index(s, 1) >= 0 && thread_index(s, 2) >= 0) {
            printf("%-34s", "  scaling, 2 threads / 1");
            for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++) {
                if (!s->selected[a])
                    continue;
                double x = scaling(s, a, p);
                char cell[32] = "-";
                if (!isnan(x))
                    snprintf(cell, sizeof cell, "%.2fx", x);
                printf("%*s", COLUMN, cell);
            }
            printf("\n");
        }
    }

    int one = thread_index(s, 1);
    if (one >= 0 && s->selected[BENCH_KVALLOC]) {
        printf("\nkvalloc, 1 thread, against bench_alloc's \"ns/op\" (= 1e9 / ops/s):");
        for (int p = PAT_BATCH64; p <= PAT_BATCH4K; p++) {
            double v = figure(BENCH_KVALLOC, p, (unsigned)one);
            if (s->pattern_on[p] && !isnan(v))
                printf("  %s %.1f M ops/s = %.2f ns/op", patterns[p].label, v / 1e6, 1e9 / v);
        }
        printf("\n(a 1-thread child still has its main thread beside the worker, so glibc takes "
               "its multi-threaded paths here\nand is slower than in bench_alloc's "
               "single-threaded children)\n");
    }

    printf("\n%-50s %-38s %s\n", "kvalloc target", "measured", "result");
    for (unsigned i = 0; i < targets; i++)
        printf("%-50s %-38s %s\n", t[i].name, t[i].detail, target_word(t[i].state));
}

/* ---- JSON ------------------------------------------------------------------------------- */

static void write_json(const struct settings *s, const struct machine *m, int argc, char **argv,
                       const struct target *t, unsigned targets)
{
    FILE *f = fopen(s->json_path, "w");
    if (f == NULL)
        bench_die("cannot write %s: %s", s->json_path, strerror(errno));
    fputs("{\n  \"tool\": \"bench_threads\",\n  \"command\": ", f);
    bench_json_command(f, argc, argv);
    fputs(",\n  ", f);
    bench_json_machine(f, m->cpu, m->cores, m->usable, m->kernel);
    fputs(", \"other_busy_cores_during_run\": ", f);
    bench_json_number(f, m->others_cores);
    fputs(", \"steal_cores_during_run\": ", f);
    bench_json_number(f, m->steal_cores);
    fprintf(f,
            "},\n  \"settings\": {\"quick\": %s, \"processes\": %u, \"measured_ms\": %u, "
            "\"warmup_ms\": %u, \"batch_objects\": %d, \"prodcons_object_bytes\": %d, "
            "\"ring_slots\": %d, \"ring_publish\": %d, \"kvalloc_pool_bytes\": %zu, "
            "\"threads\": [",
            s->quick ? "true" : "false", s->processes, s->ms, s->warmup_ms, BATCH_OBJECTS,
            PC_OBJECT, RING_SLOTS, RING_PUBLISH, POOL_CAPACITY);
    for (unsigned i = 0; i < s->thread_counts; i++)
        fprintf(f, "%s%u", i ? ", " : "", s->threads[i]);
    fputs("]},\n  \"ops_definition\": \"one op is one allocation or one free; ops_per_s = "
          "(allocations + frees of all threads) / (last thread's end - barrier release); the "
          "figure is the median over processes\",\n  \"allocators\": {",
          f);
    int first = 1;
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++) {
        if (!s->selected[a])
            continue;
        bench_json_allocator(f, first, (enum bench_allocator)a, &g_alloc[a]);
        first = 0;
        fputs(",\n      \"results\": [", f);
        int first_result = 1;
        for (int p = 0; p < PAT_COUNT; p++) {
            for (unsigned i = 0; i < s->thread_counts; i++) {
                const struct reports *r = &g_ops[a][p][i];
                if (r->count == 0)
                    continue;
                fprintf(f, "%s\n        {\"pattern\": \"%s\", \"threads\": %u, \"ops_per_s\": ",
                        first_result ? "" : ",", patterns[p].key, s->threads[i]);
                first_result = 0;
                bench_json_number(f, figure(a, p, i));
                fputs(", \"ops_per_s_reports\": [", f);
                for (unsigned k = 0; k < r->count; k++) {
                    fputs(k ? ", " : "", f);
                    bench_json_number(f, r->value[k]);
                }
                fputs("]", f);
                if (a != BENCH_KVALLOC) {
                    fputs(", \"kvalloc_over_peer\": ", f);
                    bench_json_number(f, figure(BENCH_KVALLOC, p, i) / figure(a, p, i));
                }
                if (s->threads[i] == 1) {
                    fputs(", \"ns_per_op\": ", f);
                    bench_json_number(f, 1e9 / figure(a, p, i));
                }
                fputs("}", f);
            }
        }
        fputs("],\n      \"scaling_2_over_1\": {", f);
        int first_scaling = 1;
        for (int p = PAT_BATCH64; p <= PAT_BATCH4K; p++) {
            if (!s->pattern_on[p])
                continue;
            fprintf(f, "%s\"%s\": ", first_scaling ? "" : ", ", patterns[p].key);
            bench_json_number(f, scaling(s, a, p));
            first_scaling = 0;
        }
        fputs("}}", f);
    }
    fputs("\n  },\n  \"targets\": [", f);
    for (unsigned i = 0; i < targets; i++) {
        bench_json_target(f, i == 0, t[i].key, t[i].name,
                          t[i].state == TARGET_PASS   ? "pass"
                          : t[i].state == TARGET_MISS ? "miss"
                                                      : "n/a",
                          t[i].value, t[i].reference, t[i].ratio);
        fputs(", \"detail\": ", f);
        bench_json_string(f, t[i].detail);
        fputs("}", f);
    }
    fputs("\n  ]\n}\n", f);
    if (fclose(f) != 0)
        bench_die("cannot write %s", s->json_path);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--child") == 0)
        return child_main(argc, argv);
    bench_set_identity("bench_threads", 2);

    struct settings s;
    parse_options(argc, argv, &s);

    struct machine m;
    describe_machine(&m);
    bench_discover_allocators(s.selected, g_alloc);
    struct bench_load load;
    bench_load_begin(&load);
    run_all(&s);
    bench_load_end(&load, g_children_cpu_s, &m.others_cores, &m.steal_cores);

    struct target t[MAX_TARGETS];
    unsigned targets = judge_targets(&s, &m, t);
    print_table(&s, &m, t, targets);
    if (s.json_path != NULL) {
        write_json(&s, &m, argc, argv, t, targets);
        printf("\nwrote %s\n", s.json_path);
    }
    return 0;
}
