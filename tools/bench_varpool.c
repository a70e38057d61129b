/*
 * bench_varpool.c — the variable-size pool's policies against each other and against the buddy,
 * on the same traces (docs/benchmarks.md, "Variable-size pools"):
 *
 *   activations  100,000 allocations of log-uniform sizes from 256 B to 64 MiB, each freed a
 *                log-uniform 1 .. 1,000 allocations later, in a 1 GiB pool
 *   kv-contig    the KV cache's contiguous mode: 4,000 sequences, at most 32 running, each one
 *                buffer of a power-of-two bucket of tokens (>= 64, 8 KiB per token) that moves to
 *                the next bucket as decoding outgrows it (allocate the new, free the old), in a
 *                1 GiB pool
 *   64 B batch   1,000 rounds of 1,000 allocations of 64 B, then the frees in the same order
 *
 * Every allocator replays the same operations; an allocation that fails is dropped (its free is
 * skipped). ns/op is the median over RUNS replays of the whole trace divided by its calls; for
 * the 64 B batch it comes from a loop without the trace (batch_ns), as bench_alloc measures it.
 * External fragmentation 1 - largest free / free is averaged over a sample every 16 calls of a
 * separate, untimed replay; internal waste is the allocated bytes beyond the requested ones, as
 * a share of the allocated bytes, averaged the same way. For the buddy (kva_alloc on a pool),
 * requests up to 64 KiB go to slabs: the free and largest free it reports are buddy blocks.
 * The memory is never touched.
 *
 * Usage: bench_varpool [--quick] [--seed N]   (a Markdown table; exit 1 if a target is missed:
 *                                   TLSF <= 2x the slab path's ns/op on the 64 B batch; best
 *                                   fit and TLSF fragment no more than first fit on each trace)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_clock.h"
#include "bench_random.h"
#include "kvalloc.h"

#define RUNS 5
#define SAMPLE_EVERY 16
#define CAPACITY ((size_t)1 << 30)
#define TIGHT_HEADROOM                                                                             \
    1.25 /* the tight forward-pass pool: this times the trace's peak live bytes */


static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_random(void) { return bench_xorshift64(&rng); }
static double uniform(void) { return (double)(next_random() >> 11) / 9007199254740992.0; }
static double log_uniform(double lo, double hi)
{
    return exp(log(lo) + uniform() * (log(hi) - log(lo)));
}

static void die(const char *what, kva_status st)
{
    fprintf(stderr, "bench_varpool: %s: %s (%s)\n", what, kva_strerror(st), kva_last_error());
    exit(2);
}

/* ---- traces --------------------------------------------------------------------------------- */

typedef struct op {
    uint32_t id;   /* the allocation's number */
    uint32_t free; /* 1: free id; 0: allocate size bytes as id */
    size_t size;
} op;

typedef struct trace {
    const char *name;
    op *ops;
    size_t len, cap;
    uint32_t ids;
    size_t capacity; /* of the pools that replay it */
} trace;

static void push(trace *t, uint32_t id, uint32_t is_free, size_t size)
{
    if (t->len == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 1024;
        t->ops = realloc(t->ops, t->cap * sizeof *t->ops);
        if (!t->ops)
            die("realloc", KVA_ERR_NOMEM);
    }
    t->ops[t->len++] = (op){.id = id, .free = is_free, .size = size};
}

static trace random_trace(uint32_t allocations)
{
    trace t = {.name = "random"};
    enum { MAX_LIFE = 1000 };
    /* dying[d % (MAX_LIFE + 1)] lists the ids to free before allocation d, linked through next. */
    uint32_t *head = malloc((MAX_LIFE + 1) * sizeof *head),
             *next = malloc(allocations * sizeof *next);
    if (!head || !next)
        die("malloc", KVA_ERR_NOMEM);
    for (int i = 0; i <= MAX_LIFE; i++)
        head[i] = UINT32_MAX;
    for (uint32_t i = 0; i < allocations + MAX_LIFE; i++) {
        uint32_t slot = i % (MAX_LIFE + 1);
        for (uint32_t id = head[slot]; id != UINT32_MAX; id = next[id])
            push(&t, id, 1, 0);
        head[slot] = UINT32_MAX;
        if (i >= allocations)
            continue;
        push(&t, i, 0, (size_t)log_uniform(256.0, 64.0 * 1024 * 1024));
        uint32_t life = (uint32_t)log_uniform(1.0, MAX_LIFE + 0.999);
        uint32_t death = (i + life) % (MAX_LIFE + 1);
        next[i] = head[death];
        head[death] = i;
    }
    t.ids = allocations;
    t.capacity = CAPACITY;
    free(head);
    free(next);
    return t;
}

/* The most bytes a trace holds live at once (every allocation succeeding). */
static size_t peak_live_bytes(const trace *t)
{
    size_t *size = calloc(t->ids ? t->ids : 1, sizeof *size), live = 0, peak = 0;
    if (!size)
        die("calloc", KVA_ERR_NOMEM);
    for (size_t i = 0; i < t->len; i++) {
        const op *o = &t->ops[i];
        if (o->free) {
            live -= size[o->id];
        } else {
            size[o->id] = o->size;
            live += o->size;
            if (live > peak)
                peak = live;
        }
    }
    free(size);
    return peak;
}

/* One sublayer of a transformer layer (attention, or the MLP), fed by the activation `hidden`:
 * five tensors, each made from the one before and freed once the next one exists, the last being
 * the residual, which replaces `hidden` (freed then). Returns the residual's id. */
enum { SUBLAYER_TENSORS = 5 };
static uint32_t sublayer(trace *t, uint32_t *ids, uint32_t hidden,
                         const size_t bytes[SUBLAYER_TENSORS])
{
    uint32_t first = *ids;
    *ids += SUBLAYER_TENSORS;
    push(t, first, 0, bytes[0]);
    for (uint32_t k = 1; k < SUBLAYER_TENSORS; k++) {
        push(t, first + k, 0, bytes[k]);
        push(t, first + k - 1, 1, 0);
    }
    push(t, hidden, 1, 0);
    return first + SUBLAYER_TENSORS - 1;
}

/* A decoder-only transformer served with continuous batching and chunked prefill: every step
 * runs a forward pass over the step's tokens, whose activations live from one operator to the
 * next, and the logits of a step stay alive into the next step's pass (the sampler runs while
 * the next pass starts). Each request holds a vocabulary-sized sampling buffer (penalties, logit
 * bias) from admission to its last token. The dimensions are Llama-2-7B's (hidden 4096,
 * intermediate 11008, vocabulary 32000, 32 layers; Touvron et al., 2023), activations in fp16
 * and logits in fp32. The scheduler follows vLLM's chunked prefill: decodes first, then prompt
 * chunks, within 2,048 tokens per step; at most 256 running requests, up to 4 admitted per step,
 * prompts log-uniform 16 .. 4,096 tokens, outputs log-uniform 1 .. 1,024. */
static trace forward_trace(uint32_t allocations)
{
    enum {
        HIDDEN = 4096,
        INTER = 11008,
        VOCAB = 32000,
        LAYERS = 32,
        MAX_RUNNING = 256,
        BUDGET = 2048,
        ADMIT = 4
    };
    const size_t half = 2, single = 4; /* bytes per fp16 and fp32 element */
    trace t = {.name = "forward passes"};
    struct request {
        uint32_t prompt, prefilled, output, generated, state;
    } run[MAX_RUNNING];
    int running = 0;
    uint32_t ids = 0, logits = UINT32_MAX;
    while (ids < allocations || running > 0) {
        for (int k = 0; k < ADMIT && running < MAX_RUNNING && ids < allocations; k++) {
            struct request *r = &run[running++];
            r->prompt = (uint32_t)log_uniform(16.0, 4096.0);
            r->output = (uint32_t)log_uniform(1.0, 1024.999);
            r->prefilled = r->generated = 0;
            r->state = ids++;
            push(&t, r->state, 0, VOCAB * single);
        }
        size_t tokens = 0, producing = 0;
        for (int i = 0; i < running; i++) /* decodes first */
            if (run[i].prefilled == run[i].prompt && tokens < BUDGET) {
                tokens++;
                producing++;
                run[i].generated++;
            }
        for (int i = 0; i < running && tokens < BUDGET; i++) { /* then prompt chunks */
            struct request *r = &run[i];
            if (r->prefilled == r->prompt)
                continue;
            uint32_t chunk = r->prompt - r->prefilled;
            if (chunk > BUDGET - tokens)
                chunk = (uint32_t)(BUDGET - tokens);
            tokens += chunk;
            r->prefilled += chunk;
            if (r->prefilled == r->prompt) {
                producing++;
                r->generated++;
            }
        }
        const size_t row = tokens * HIDDEN * half;
        uint32_t hidden = ids++;
        push(&t, hidden, 0, row);
        for (int layer = 0; layer < LAYERS; layer++) {
            if (layer == LAYERS / 2 &&
                logits != UINT32_MAX) { /* the previous step's sampler is done */
                push(&t, logits, 1, 0);
                logits = UINT32_MAX;
            }
            /* attention: norm, qkv, attention, projection, residual */
            hidden = sublayer(&t, &ids, hidden,
                              (const size_t[SUBLAYER_TENSORS]){row, 3 * row, row, row, row});
            /* MLP: norm, gate and up, activation, down, residual */
            hidden = sublayer(&t, &ids, hidden,
                              (const size_t[SUBLAYER_TENSORS]){row, tokens * 2 * INTER * half,
                                                               tokens * INTER * half, row, row});
        }
        if (logits != UINT32_MAX)
            push(&t, logits, 1, 0);
        logits = UINT32_MAX;
        if (producing > 0) {
            logits = ids++;
            push(&t, logits, 0, producing * VOCAB * single);
        }
        push(&t, hidden, 1, 0);
        for (int i = 0; i < running;) /* finished requests leave; the rest keep their order */
            if (run[i].generated >= run[i].output) {
                push(&t, run[i].state, 1, 0);
                memmove(&run[i], &run[i + 1], (size_t)(running - i - 1) * sizeof run[0]);
                running--;
            } else {
                i++;
            }
    }
    if (logits != UINT32_MAX)
        push(&t, logits, 1, 0);
    t.ids = ids;
    t.capacity = CAPACITY;
    return t;
}

static size_t bucket_of(uint32_t tokens)
{
    uint32_t bucket = 64;
    while (bucket < tokens)
        bucket <<= 1;
    return bucket;
}

static trace kv_trace(uint32_t sequences)
{
    enum { RUNNING = 32, TOKEN_BYTES = 8192 };
    trace t = {.name = "kv-contig"};
    struct seq {
        uint32_t id, tokens, end;
        int live;
    } run[RUNNING] = {{0}};
    uint32_t started = 0, ids = 0, finished = 0;
    while (finished < sequences) {
        for (int s = 0; s < RUNNING; s++) {
            struct seq *q = &run[s];
            if (!q->live) {
                if (started == sequences)
                    continue;
                started++;
                q->tokens = (uint32_t)log_uniform(64.0, 8192.0);
                q->end = q->tokens + 1 + (uint32_t)(next_random() % 1024);
                q->id = ids++;
                q->live = 1;
                push(&t, q->id, 0, bucket_of(q->tokens) * TOKEN_BYTES);
                continue;
            }
            q->tokens++; /* one decode step */
            if (q->tokens > bucket_of(q->tokens - 1)) {
                uint32_t moved = ids++;
                push(&t, moved, 0, bucket_of(q->tokens) * TOKEN_BYTES);
                push(&t, q->id, 1, 0);
                q->id = moved;
            }
            if (q->tokens == q->end) {
                push(&t, q->id, 1, 0);
                q->live = 0;
                finished++;
            }
        }
    }
    t.ids = ids;
    t.capacity = CAPACITY;
    return t;
}

static trace batch_trace(int rounds)
{
    trace t = {.name = "64 B batch"};
    for (int r = 0; r < rounds; r++) {
        for (uint32_t i = 0; i < 1000; i++)
            push(&t, i, 0, 64);
        for (uint32_t i = 0; i < 1000; i++)
            push(&t, i, 1, 0);
    }
    t.ids = 1000;
    t.capacity = CAPACITY;
    return t;
}

/* ---- allocators ----------------------------------------------------------------------------- */

enum { BUDDY = 0, NUM_ALLOCATORS = 5 };
static const char *const allocator_names[NUM_ALLOCATORS] = {"buddy", "first fit", "best fit",
                                                            "worst fit", "TLSF"};
static const kva_var_policy policy_of[NUM_ALLOCATORS] = {0, KVA_VAR_FIRST_FIT, KVA_VAR_BEST_FIT,
                                                         KVA_VAR_WORST_FIT, KVA_VAR_TLSF};

typedef struct allocator {
    int which;
    kva_pool *pool;
    kva_var *var;
} allocator;

static allocator open_allocator(int which, size_t capacity)
{
    allocator a = {.which = which};
    kva_status st;
    if (which == BUDDY) {
        kva_config cfg;
        kva_config_init(&cfg);
        cfg.capacity = capacity;
        cfg.pages = KVA_PAGES_THP;
        st = kva_pool_create(&cfg, &a.pool);
    } else {
        kva_var_config cfg;
        kva_var_config_init(&cfg);
        cfg.capacity = capacity;
        cfg.policy = policy_of[which];
        st = kva_var_create(&cfg, NULL, &a.var);
    }
    if (st != KVA_OK)
        die("create", st);
    return a;
}

static void close_allocator(allocator *a)
{
    kva_pool_destroy(a->pool);
    kva_var_destroy(a->var);
}

/* The replay loop, through direct calls: the var pool's and the buddy's loops are separate so
 * that neither pays a dispatch. Returns the calls made; failed[id] marks dropped allocations. */
static size_t replay(allocator *a, const trace *t, void **live, uint8_t *failed)
{
    size_t calls = 0;
    if (a->var) {
        for (size_t i = 0; i < t->len; i++) {
            const op *o = &t->ops[i];
            if (o->free) {
                if (failed[o->id])
                    continue;
                kva_var_free(a->var, live[o->id]);
            } else {
                failed[o->id] = kva_var_alloc(a->var, o->size, &live[o->id]) != KVA_OK;
            }
            calls++;
        }
    } else {
        for (size_t i = 0; i < t->len; i++) {
            const op *o = &t->ops[i];
            if (o->free) {
                if (failed[o->id])
                    continue;
                kva_free(a->pool, live[o->id]);
            } else {
                failed[o->id] = kva_alloc(a->pool, o->size, &live[o->id]) != KVA_OK;
            }
            calls++;
        }
    }
    return calls;
}

typedef struct result {
    double ns_per_op, fragmentation, waste, failures;
    double footprint; /* the highest offset any allocation reached, over the peak live bytes */
} result;

/* The untimed replay with samples: fragmentation, internal waste, failures. */
static void measure_quality(int which, const trace *t, void **live, uint8_t *failed, result *r)
{
    allocator a = open_allocator(which, t->capacity);
    size_t *usable = calloc(t->ids, sizeof *usable), *asked = calloc(t->ids, sizeof *asked);
    if (!usable || !asked)
        die("calloc", KVA_ERR_NOMEM);
    double frag_sum = 0, waste_sum = 0;
    size_t samples = 0, waste_samples = 0, failures = 0, requested = 0, allocated = 0;
    size_t high = 0, live_peak = 0; /* the footprint's two terms */
    char *base;
    kva_status bst = a.var ? kva_var_base(a.var, (void **)&base)
                           : kva_pool_base(a.pool, (void **)&base);
    if (bst != KVA_OK)
        die("base", bst);
    for (size_t i = 0; i < t->len; i++) {
        const op *o = &t->ops[i];
        if (o->free) {
            /* The free of a failed allocation is skipped, but not the sample at its step: every
             * allocator is sampled at the same steps of the trace, however often it fails. */
            if (!failed[o->id]) {
                requested -= asked[o->id];
                allocated -= usable[o->id];
                if (a.var)
                    kva_var_free(a.var, live[o->id]);
                else
                    kva_free(a.pool, live[o->id]);
            }
        } else {
            kva_status st = a.var ? kva_var_alloc(a.var, o->size, &live[o->id])
                                  : kva_alloc(a.pool, o->size, &live[o->id]);
            failed[o->id] = st != KVA_OK;
            if (st == KVA_OK) {
                usable[o->id] = a.var ? kva_var_usable_size(a.var, live[o->id])
                                      : kva_usable_size(a.pool, live[o->id]);
                asked[o->id] = o->size;
                allocated += usable[o->id];
                requested += o->size;
                size_t end = (size_t)((char *)live[o->id] - base) + usable[o->id];
                if (end > high)
                    high = end;
                if (requested > live_peak)
                    live_peak = requested;
            } else {
                failures++;
            }
        }
        if (i % SAMPLE_EVERY == 0) {
            size_t bytes_free, largest;
            if (a.var) {
                kva_var_stats s;
                kva_var_get_stats(a.var, &s);
                bytes_free = s.bytes_free;
                largest = s.largest_free;
            } else {
                kva_stats s;
                kva_get_stats(a.pool, &s);
                bytes_free = s.bytes_free;
                largest = s.largest_free;
            }
            if (bytes_free) {
                frag_sum += 1.0 - (double)largest / (double)bytes_free;
                samples++;
            }
            if (allocated) {
                waste_sum += (double)(allocated - requested) / (double)allocated;
                waste_samples++;
            }
        }
    }
    r->fragmentation = samples ? frag_sum / (double)samples : 0;
    r->waste = waste_samples ? waste_sum / (double)waste_samples : 0;
    r->failures = (double)failures;
    r->footprint = live_peak ? (double)high / (double)live_peak : 0;
    free(usable);
    free(asked);
    close_allocator(&a);
}

static result run_trace(int which, const trace *t)
{
    void **live = calloc(t->ids, sizeof *live);
    uint8_t *failed = calloc(t->ids, 1);
    if (!live || !failed)
        die("calloc", KVA_ERR_NOMEM);
    result r;
    double ns[RUNS];
    for (int run = 0; run < RUNS; run++) {
        allocator a = open_allocator(which, t->capacity);
        /* Warm-up on the same allocator (every trace ends with everything freed): the first
         * touch of each metadata page is not what is measured. */
        replay(&a, t, live, failed);
        double t0 = bench_now_ns();
        size_t calls = replay(&a, t, live, failed);
        ns[run] = (bench_now_ns() - t0) / (double)calls;
        close_allocator(&a);
    }
    qsort(ns, RUNS, sizeof *ns, bench_cmp_double);
    r.ns_per_op = ns[RUNS / 2];
    measure_quality(which, t, live, failed, &r);
    free(live);
    free(failed);
    return r;
}

/* The 64 B batch as bench_alloc times it, without a trace in between: 1,000 allocations into an
 * array, then the 1,000 frees in order, `rounds` times after one round of warm-up, on a fresh
 * pool. ns per call. */
static double batch_run(int which, int rounds)
{
    static void *p[1000];
    allocator a = open_allocator(which, CAPACITY);
    double t0 = 0;
    for (int r = -1; r < rounds; r++) {
        if (r == 0)
            t0 = bench_now_ns();
        if (a.var) {
            for (int i = 0; i < 1000; i++)
                kva_var_alloc(a.var, 64, &p[i]);
            for (int i = 0; i < 1000; i++)
                kva_var_free(a.var, p[i]);
        } else {
            for (int i = 0; i < 1000; i++)
                kva_alloc(a.pool, 64, &p[i]);
            for (int i = 0; i < 1000; i++)
                kva_free(a.pool, p[i]);
        }
    }
    double ns = (bench_now_ns() - t0) / (2000.0 * rounds);
    close_allocator(&a);
    return ns;
}

/* batch_run's median over RUNS runs for every allocator, the runs taking turns across the
 * allocators, so that the machine's drift during the measurement falls on all of them alike
 * (the TLSF target is a ratio of two of these figures). */
static void batch_ns(int rounds, double out[NUM_ALLOCATORS])
{
    double ns[NUM_ALLOCATORS][RUNS];
    for (int run = 0; run < RUNS; run++)
        for (int a = 0; a < NUM_ALLOCATORS; a++)
            ns[a][run] = batch_run(a, rounds);
    for (int a = 0; a < NUM_ALLOCATORS; a++) {
        qsort(ns[a], RUNS, sizeof ns[a][0], bench_cmp_double);
        out[a] = ns[a][RUNS / 2];
    }
}

int main(int argc, char **argv)
{
    int quick = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = 1;
        else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc)
            rng = strtoull(argv[++i], NULL, 0) ? strtoull(argv[i], NULL, 0) : rng;
        else {
            fprintf(stderr, "usage: bench_varpool [--quick] [--seed N]\n");
            return 2;
        }
    }
    enum { QUALITY_TRACES = 4, BATCH = 4, TRACES = 5 }; /* the batch trace is last */
    trace forward = forward_trace(quick ? 10000 : 100000);
    /* The same passes in a pool sized as an engine sizes its activation pool: from a profiling
     * pass over the largest batch (vLLM does this), leaving the rest of the device to the KV
     * cache. With little room to spare, fragmentation shows as failures. */
    trace tight = forward;
    tight.name = "forward passes, tight pool";
    const size_t peak = peak_live_bytes(&forward);
    tight.capacity = (size_t)((double)peak * TIGHT_HEADROOM);
    tight.capacity = (tight.capacity + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
    trace traces[TRACES] = {forward, tight, random_trace(quick ? 10000 : 100000),
                            kv_trace(quick ? 400 : 4000), batch_trace(quick ? 100 : 1000)};
    printf("forward passes: peak live %.1f MiB; pools of %.1f MiB (tight) and %zu MiB (the "
           "others)\n\n",
           (double)peak / 1048576.0, (double)tight.capacity / 1048576.0, CAPACITY >> 20);
    result results[TRACES][NUM_ALLOCATORS];
    for (int t = 0; t < TRACES; t++)
        for (int a = 0; a < NUM_ALLOCATORS; a++)
            results[t][a] = run_trace(a, &traces[t]);
    double batch[NUM_ALLOCATORS];
    batch_ns(quick ? 100 : 1000, batch);
    for (int a = 0; a < NUM_ALLOCATORS; a++)
        results[BATCH][a].ns_per_op = batch[a];

    printf("| trace | figure |");
    for (int a = 0; a < NUM_ALLOCATORS; a++)
        printf(" %s |", allocator_names[a]);
    printf("\n|---|---|");
    for (int a = 0; a < NUM_ALLOCATORS; a++)
        printf("---:|");
    printf("\n");
    for (int t = 0; t < TRACES; t++) {
        printf("| %s (%zu calls) | ns/op |", traces[t].name, traces[t].len);
        for (int a = 0; a < NUM_ALLOCATORS; a++)
            printf(" %.2f |", results[t][a].ns_per_op);
        printf("\n| | external fragmentation |");
        for (int a = 0; a < NUM_ALLOCATORS; a++)
            printf(" %.1f%% |", 100 * results[t][a].fragmentation);
        printf("\n| | internal waste |");
        for (int a = 0; a < NUM_ALLOCATORS; a++)
            printf(" %.2f%% |", 100 * results[t][a].waste);
        printf("\n| | footprint / peak live |");
        for (int a = 0; a < NUM_ALLOCATORS; a++)
            printf(" %.3f |", results[t][a].footprint);
        printf("\n| | failed allocations |");
        for (int a = 0; a < NUM_ALLOCATORS; a++)
            printf(" %.0f |", results[t][a].failures);
        printf("\n");
    }

    enum { FIRST = 1, BEST = 2, TLSF = 4 };
    double slab = results[BATCH][BUDDY].ns_per_op, tlsf = results[BATCH][TLSF].ns_per_op;
    int ok = tlsf <= 2 * slab;
    printf("\nTLSF %.2f ns/op vs the slab path %.2f on the 64 B batch: %.2fx (target <= 2x): %s\n",
           tlsf, slab, tlsf / slab, tlsf <= 2 * slab ? "pass" : "FAIL");
    for (int t = 0; t < QUALITY_TRACES; t++) {
        const result *r = results[t];
        int pass = r[BEST].fragmentation <= r[FIRST].fragmentation &&
                   r[TLSF].fragmentation <= r[FIRST].fragmentation;
        printf("%s: fragmentation best %.1f%%, TLSF %.1f%% vs first fit %.1f%% (target <=): %s\n",
               traces[t].name, 100 * r[BEST].fragmentation, 100 * r[TLSF].fragmentation,
               100 * r[FIRST].fragmentation, pass ? "pass" : "FAIL");
        ok &= pass;
    }
    for (int t = 1; t < TRACES; t++)
        free(traces[t].ops); /* tight shares forward's */
    return ok ? 0 : 1;
}
