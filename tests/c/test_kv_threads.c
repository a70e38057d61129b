/*
 * test_kv_threads.c — one KV cache and one variable-size pool driven by several threads at once.
 *
 * KV (paged): each worker thread keeps its own sequences and runs a realistic mix on the shared
 * cache: allocations whose first blocks are keyed from a few shared prefix families (so blocks
 * are shared between threads and cached, hit and evicted), appends (copy on write after forks),
 * forks, frees, pins with a follow-up allocation that must hit at least the pinned prefix,
 * evictions, and deliberate bad calls whose error text (kva_last_error, per thread) must name
 * this thread's mistake. Each thread checks its own sequences after every call; a checker thread
 * runs kva_kv_check and a stats snapshot's invariants meanwhile, and compacts now and then
 * (compaction rewrites every block table in place, so block-table reads and compaction are
 * ordered by a test-side rwlock: the documented contract). After joining: kva_kv_check passes,
 * every counter equals the sum of what the threads saw, no block is used, free + cached ==
 * total, and evicting everything leaves every block free.
 *
 * The same mix again on a named cache (whose calls publish the pool's statistics and the KV
 * section through the pool's publisher hook) while another thread publishes the pool over and
 * over: the hook must never block on the cache's lock, so this finishes instead of deadlocking.
 *
 * KV (contiguous): threads allocate, grow (bucket moves, pool allocations under the cache's
 * lock) and free buffers; afterwards the cache and its pool check out and hold nothing.
 *
 * VarPool: threads allocate random sizes under each policy, stamp both ends of every range,
 * verify the stamps and the usable size at free (overlapping ranges would break a stamp), and
 * make refused calls; a checker thread runs kva_var_check and kva_var_get_stats meanwhile. After
 * joining: the check passes and the statistics balance.
 *
 * Usage: test_kv_threads [scale]   (operations per thread are multiplied by scale, default 1)
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "kv_test.h"
#include "thread_util.h" /* TCHECK, TCHECK_STATUS: counted atomically, merged at the end */

static int scale = 1;

typedef struct rng {
    uint64_t s;
} rng;

static uint32_t rnd(rng *r, uint32_t n) {
    r->s = r->s * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((r->s >> 33) % n);
}

static uint32_t div_up(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

static int done_flag(const int *flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

/* ------------------------------------------------------------------------------------------ */
/* Paged KV                                                                                   */
/* ------------------------------------------------------------------------------------------ */

#define KV_THREADS 6
#define KV_BLOCKS 160u
#define BT 4u
#define FAMILIES 6u      /* shared prefix families of keys */
#define FAMILY_BLOCKS 6u /* keyed blocks per family */
#define MAX_LIVE 6       /* sequences a thread holds at most */
#define MAX_TABLE 64

typedef struct tseq {
    kva_kv_seq handle;
    uint32_t tokens;
    int is_pin;
} tseq;

/* What one worker did, summed and compared with the cache's counters after the join. */
typedef struct kv_tally {
    uint64_t allocations, frees, forks, appends, nomem, rejected, cow, pins, pin_checks;
} kv_tally;

typedef struct kv_worker {
    kva_kv *kv;
    int id;
    uint32_t ops;
    kv_tally t;
} kv_worker;

static pthread_rwlock_t table_guard = PTHREAD_RWLOCK_INITIALIZER; /* block tables vs compaction */
static int kv_done;
/* Rounds the checker and publishes the publisher have completed. Each worker waits halfway for
 * one of each, so that both ran while the workers did, however the threads are scheduled. */
static uint64_t checker_rounds, publisher_rounds;
static int kv_named;

static void wait_for_observers(void) {
    while (__atomic_load_n(&checker_rounds, __ATOMIC_ACQUIRE) == 0 ||
           (kv_named && __atomic_load_n(&publisher_rounds, __ATOMIC_ACQUIRE) == 0))
        sched_yield();
}

static void family_keys(uint32_t family, uint64_t *keys, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) keys[i] = 0x1000u * (family + 1) + i;
}

/* Checks one of this thread's sequences against what the thread knows of it. */
static void verify_seq(kva_kv *kv, const tseq *s) {
    kva_kv_seq_info info;
    TCHECK_STATUS(kva_kv_seq_get_info(kv, s->handle, &info), KVA_OK);
    TCHECK(info.num_tokens == s->tokens);
    TCHECK(info.is_pin == (uint32_t)s->is_pin);
    if (!s->is_pin) TCHECK(info.num_blocks == div_up(s->tokens, BT));
    pthread_rwlock_rdlock(&table_guard);
    const uint32_t *table;
    uint32_t len;
    TCHECK_STATUS(kva_kv_seq_block_table(kv, s->handle, &table, &len), KVA_OK);
    TCHECK(len == info.num_blocks);
    for (uint32_t i = 0; i < len; i++) TCHECK(table[i] < KV_BLOCKS);
    /* A table never names a block twice (each entry is one reference of this sequence). */
    for (uint32_t i = 0; i < len; i++)
        for (uint32_t j = i + 1; j < len; j++) TCHECK(table[i] != table[j]);
    pthread_rwlock_unlock(&table_guard);
}

static void *kv_worker_main(void *arg) {
    kv_worker *w = arg;
    kva_kv *kv = w->kv;
    rng r = {0x9e3779b97f4a7c15ull * (uint64_t)(w->id + 1)};
    tseq live[MAX_LIVE];
    int nlive = 0;
    kva_kv_seq freed_handle = 0; /* a handle this thread freed, for a deliberate double free */
    uint64_t keys[FAMILY_BLOCKS];

    for (uint32_t op = 0; op < w->ops; op++) {
        if (op == w->ops / 2) wait_for_observers();
        uint32_t what = rnd(&r, 100);
        if (what < 30 && nlive < MAX_LIVE) {
            /* Allocate: a keyed prefix of a shared family, then private blocks. */
            uint32_t family = rnd(&r, FAMILIES), nkeys = rnd(&r, FAMILY_BLOCKS + 1);
            uint32_t tokens = nkeys * BT + rnd(&r, 3 * BT);
            if (tokens == 0) tokens = 1;
            family_keys(family, keys, nkeys);
            uint32_t ns = (uint32_t)w->id % 2, prio = rnd(&r, KVA_KV_PRIORITIES), cached = UINT32_MAX;
            kva_kv_seq h = 0;
            kva_status st = kva_kv_seq_allocate(kv, tokens, keys, nkeys, NULL, 0, ns, prio, &h, &cached);
            if (st == KVA_ERR_NOMEM) {
                w->t.nomem++;
                TCHECK(h == 0 && cached == UINT32_MAX); /* out-parameters untouched */
                continue;
            }
            TCHECK_STATUS(st, KVA_OK);
            if (st != KVA_OK) continue;
            w->t.allocations++;
            TCHECK(cached % BT == 0 && cached <= nkeys * BT);
            live[nlive] = (tseq){h, tokens, 0};
            verify_seq(kv, &live[nlive]);
            nlive++;
        } else if (what < 55 && nlive > 0) {
            /* Append (decode). */
            tseq *s = &live[rnd(&r, (uint32_t)nlive)];
            if (s->is_pin) {
                kva_kv_copy copy;
                TCHECK_STATUS(kva_kv_seq_append(kv, s->handle, 1, &copy), KVA_ERR_INVALID);
                TCHECK(strstr(kva_last_error(), "pin") != NULL);
                w->t.rejected++;
                continue;
            }
            uint32_t n = 1 + rnd(&r, 2 * BT);
            if (div_up(s->tokens + n, BT) > MAX_TABLE) n = 0;
            kva_kv_copy copy;
            kva_status st = kva_kv_seq_append(kv, s->handle, n, &copy);
            if (st == KVA_ERR_NOMEM) {
                w->t.nomem++;
                verify_seq(kv, s); /* unchanged */
                continue;
            }
            TCHECK_STATUS(st, KVA_OK);
            if (st != KVA_OK) continue;
            w->t.appends++;
            if (copy.src_block != KVA_KV_NO_BLOCK) {
                w->t.cow++;
                TCHECK(copy.dst_block != copy.src_block && copy.tokens == s->tokens % BT && copy.tokens > 0);
            }
            s->tokens += n;
            verify_seq(kv, s);
        } else if (what < 65 && nlive > 0 && nlive < MAX_LIVE) {
            /* Fork: same tokens, same blocks. */
            tseq *parent = &live[rnd(&r, (uint32_t)nlive)];
            kva_kv_seq child = 0;
            if (parent->is_pin) {
                TCHECK_STATUS(kva_kv_seq_fork(kv, parent->handle, &child), KVA_ERR_INVALID);
                w->t.rejected++;
                continue;
            }
            kva_status st = kva_kv_seq_fork(kv, parent->handle, &child);
            if (st == KVA_ERR_NOMEM) { /* host memory only: not expected, but allowed */
                w->t.nomem++;
                continue;
            }
            TCHECK_STATUS(st, KVA_OK);
            if (st != KVA_OK) continue;
            w->t.forks++;
            live[nlive] = (tseq){child, parent->tokens, 0};
            verify_seq(kv, &live[nlive]);
            /* The child names exactly the parent's blocks (no compaction in between). */
            pthread_rwlock_rdlock(&table_guard);
            const uint32_t *pt, *ct;
            uint32_t pl, cl;
            TCHECK_STATUS(kva_kv_seq_block_table(kv, parent->handle, &pt, &pl), KVA_OK);
            TCHECK_STATUS(kva_kv_seq_block_table(kv, child, &ct, &cl), KVA_OK);
            TCHECK(pl == cl && memcmp(pt, ct, pl * sizeof *pt) == 0);
            pthread_rwlock_unlock(&table_guard);
            nlive++;
        } else if (what < 85 && nlive > 0) {
            /* Free (or unpin). */
            uint32_t i = rnd(&r, (uint32_t)nlive);
            tseq s = live[i];
            if (s.is_pin) {
                TCHECK_STATUS(kva_kv_seq_free(kv, s.handle), KVA_ERR_INVALID); /* a pin, not a sequence */
                w->t.rejected++;
                TCHECK_STATUS(kva_kv_unpin(kv, s.handle), KVA_OK);
            } else {
                TCHECK_STATUS(kva_kv_seq_free(kv, s.handle), KVA_OK);
                w->t.frees++;
                freed_handle = s.handle;
            }
            live[i] = live[--nlive];
        } else if (what < 90 && nlive < MAX_LIVE - 1) {
            /* Pin a family's cached prefix, then allocate it: the pinned blocks cannot have been
             * evicted in between, whatever the other threads did. */
            uint32_t family = rnd(&r, FAMILIES), ns = (uint32_t)w->id % 2;
            family_keys(family, keys, FAMILY_BLOCKS);
            kva_kv_seq pin = 0;
            uint32_t pinned = UINT32_MAX;
            TCHECK_STATUS(kva_kv_pin(kv, keys, FAMILY_BLOCKS, NULL, 0, ns, &pin, &pinned), KVA_OK);
            TCHECK(pinned % BT == 0 && pinned <= FAMILY_BLOCKS * BT);
            w->t.pins++;
            live[nlive++] = (tseq){pin, pinned, 1};
            verify_seq(kv, &live[nlive - 1]);
            kva_kv_seq h = 0;
            uint32_t cached = 0;
            kva_status st = kva_kv_seq_allocate(kv, FAMILY_BLOCKS * BT, keys, FAMILY_BLOCKS, NULL, 0, ns, 0, &h,
                                                &cached);
            if (st == KVA_ERR_NOMEM) {
                w->t.nomem++;
            } else {
                TCHECK_STATUS(st, KVA_OK);
                if (st == KVA_OK) {
                    w->t.allocations++;
                    w->t.pin_checks++;
                    TCHECK(cached >= pinned);
                    live[nlive++] = (tseq){h, FAMILY_BLOCKS * BT, 0};
                }
            }
        } else if (what < 94) {
            uint32_t evicted = UINT32_MAX;
            TCHECK_STATUS(kva_kv_evict(kv, 1 + rnd(&r, 8), &evicted), KVA_OK);
            TCHECK(evicted <= 8);
        } else if (what < 97 && freed_handle) {
            /* A double free: refused with this thread's own explanation. */
            TCHECK_STATUS(kva_kv_seq_free(kv, freed_handle), KVA_ERR_DOUBLE_FREE);
            char expect[64];
            snprintf(expect, sizeof expect, "%#llx", (unsigned long long)freed_handle);
            TCHECK(strstr(kva_last_error(), expect) != NULL && strstr(kva_last_error(), "already freed") != NULL);
            w->t.rejected++;
        } else {
            for (int i = 0; i < nlive; i++) verify_seq(kv, &live[i]);
        }
    }
    for (int i = 0; i < nlive; i++) {
        verify_seq(kv, &live[i]);
        if (live[i].is_pin) {
            TCHECK_STATUS(kva_kv_unpin(kv, live[i].handle), KVA_OK);
        } else {
            TCHECK_STATUS(kva_kv_seq_free(kv, live[i].handle), KVA_OK);
            w->t.frees++;
        }
    }
    return NULL;
}

/* Meanwhile: the whole-cache check, snapshot invariants, and compaction now and then. */
static void *kv_checker_main(void *arg) {
    kva_kv *kv = arg;
    kva_kv_move *moves = calloc(KV_BLOCKS, sizeof *moves);
    REQUIRE(moves);
    uint64_t rounds = 0, compactions = 0;
    while (!done_flag(&kv_done)) {
        TCHECK_STATUS(kva_kv_check(kv), KVA_OK);
        kva_kv_stats st;
        TCHECK_STATUS(kva_kv_get_stats(kv, &st), KVA_OK);
        TCHECK(st.free_blocks + st.used_blocks + st.cached_blocks == KV_BLOCKS);
        TCHECK(st.cached_blocks <= st.registered_blocks);
        TCHECK(st.hit_tokens <= st.query_tokens);
        if (++rounds % 4 == 0) {
            uint32_t count = 0;
            pthread_rwlock_wrlock(&table_guard);
            TCHECK_STATUS(kva_kv_compact(kv, moves, KV_BLOCKS, &count), KVA_OK);
            pthread_rwlock_unlock(&table_guard);
            for (uint32_t i = 0; i < count; i++) TCHECK(moves[i].src_block > moves[i].dst_block);
            compactions++;
        }
        __atomic_store_n(&checker_rounds, rounds, __ATOMIC_RELEASE);
        usleep(200);
    }
    free(moves);
    TCHECK(rounds > 0);
    (void)compactions;
    return NULL;
}

/* Publishes the cache's pool (and through the hook the cache's section) over and over, while
 * the cache's own calls publish too: the hook must never wait for the cache's lock. */
static void *kv_publisher_main(void *arg) {
    kva_kv *kv = arg;
    kva_kv_info info;
    REQUIRE(kva_kv_get_info(kv, &info) == KVA_OK);
    uint64_t publishes = 0;
    while (!done_flag(&kv_done)) {
        TCHECK_STATUS(kva_stats_publish(info.pool), KVA_OK);
        publishes++;
        __atomic_store_n(&publisher_rounds, publishes, __ATOMIC_RELEASE);
        usleep(100);
    }
    TCHECK(publishes > 0);
    return NULL;
}

/* named: the cache is built on a named pool publishing every millisecond (the cache's calls
 * publish it, through the hook), and a publisher thread runs beside the workers and the
 * checker. */
static void test_paged(int named) {
    kva_kv_config cfg = small_config(KV_BLOCKS, BT);
    kva_pool *pool = NULL;
    kva_kv *kv = NULL;
    if (named) {
        char name[64];
        snprintf(name, sizeof name, "kvthreads.%d", (int)getpid());
        kva_config pc;
        kva_config_init(&pc);
        pc.capacity = (size_t)1 << 20;
        pc.pages = KVA_PAGES_SMALL;
        pc.name = name;
        pc.publish_interval_ms = 1;
        REQUIRE(kva_pool_create(&pc, &pool) == KVA_OK);
        REQUIRE(kva_stats_segment_name(pool) != NULL);
        cfg.trace = 1;
        REQUIRE(kva_kv_create(&cfg, pool, &kv) == KVA_OK);
    } else {
        kv = make_cache(&cfg);
    }
    kv_worker workers[KV_THREADS];
    pthread_t threads[KV_THREADS], checker, publisher;
    kv_done = 0;
    checker_rounds = publisher_rounds = 0;
    kv_named = named;
    for (int i = 0; i < KV_THREADS; i++) {
        workers[i] = (kv_worker){.kv = kv, .id = i, .ops = (named ? 5000u : 15000u) * (uint32_t)scale};
        REQUIRE(pthread_create(&threads[i], NULL, kv_worker_main, &workers[i]) == 0);
    }
    REQUIRE(pthread_create(&checker, NULL, kv_checker_main, kv) == 0);
    if (named) REQUIRE(pthread_create(&publisher, NULL, kv_publisher_main, kv) == 0);
    for (int i = 0; i < KV_THREADS; i++) pthread_join(threads[i], NULL);
    __atomic_store_n(&kv_done, 1, __ATOMIC_RELEASE);
    pthread_join(checker, NULL);
    if (named) pthread_join(publisher, NULL);

    kv_tally sum = {0};
    for (int i = 0; i < KV_THREADS; i++) {
        const kv_tally *t = &workers[i].t;
        sum.allocations += t->allocations;
        sum.frees += t->frees;
        sum.forks += t->forks;
        sum.appends += t->appends;
        sum.nomem += t->nomem;
        sum.rejected += t->rejected;
        sum.cow += t->cow;
        sum.pins += t->pins;
        sum.pin_checks += t->pin_checks;
    }
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_stats st = stats(kv);
    CHECK(st.sequences == 0 && st.pins == 0);
    CHECK(st.used_blocks == 0);
    CHECK(st.free_blocks + st.cached_blocks == st.num_blocks && st.num_blocks == KV_BLOCKS);
    CHECK(st.bytes_in_use == 0);
    CHECK(st.allocations == sum.allocations);
    CHECK(st.frees == sum.frees);
    CHECK(st.forks == sum.forks);
    CHECK(st.appends == sum.appends);
    CHECK(st.cow_copies == sum.cow);
    CHECK(st.alloc_failures == sum.nomem);
    CHECK(st.rejected_calls == sum.rejected);
    /* The mix really shared and evicted blocks across threads. */
    CHECK(st.hit_tokens > 0);
    CHECK(st.evictions > 0);
    CHECK(sum.forks > 0 && sum.cow > 0 && sum.pins > 0 && sum.pin_checks > 0);
    if (named) CHECK(st.timed_calls > 0);
    uint32_t evicted = 0, cached_before = st.cached_blocks;
    CHECK_STATUS(kva_kv_evict(kv, UINT32_MAX, &evicted), KVA_OK);
    CHECK(evicted == cached_before);
    st = stats(kv);
    CHECK(st.free_blocks == KV_BLOCKS && st.cached_blocks == 0 && st.registered_blocks == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    printf("paged%s: %llu allocations (%llu hit tokens of %llu), %llu forks, %llu CoW, %llu appends, "
           "%llu evictions, %llu NOMEM, %llu refused, %llu compaction moves\n",
           named ? " (named, published)" : "", (unsigned long long)st.allocations, (unsigned long long)st.hit_tokens,
           (unsigned long long)st.query_tokens, (unsigned long long)st.forks, (unsigned long long)st.cow_copies,
           (unsigned long long)st.appends, (unsigned long long)st.evictions, (unsigned long long)st.alloc_failures,
           (unsigned long long)st.rejected_calls, (unsigned long long)st.moves);
    kva_kv_destroy(kv);
    if (pool) {
        CHECK_STATUS(kva_check(pool), KVA_OK);
        kva_pool_destroy(pool);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Contiguous KV: every sequence call allocates from the pool under the cache's lock          */
/* ------------------------------------------------------------------------------------------ */

#define CONTIG_THREADS 4

typedef struct contig_worker {
    kva_kv *kv;
    int id;
    uint32_t ops;
    uint64_t allocations, frees, appends, moves, nomem;
} contig_worker;

static void *contig_worker_main(void *arg) {
    contig_worker *w = arg;
    rng r = {0xd1b54a32d192ed03ull * (uint64_t)(w->id + 1)};
    kva_kv_seq seqs[4];
    uint32_t tokens[4];
    int n = 0;
    for (uint32_t op = 0; op < w->ops; op++) {
        uint32_t what = rnd(&r, 10);
        if (what < 3 && n < 4) {
            uint32_t t = 1 + rnd(&r, 200);
            kva_kv_seq h;
            kva_status st = kva_kv_seq_allocate(w->kv, t, NULL, 0, NULL, 0, 0, 0, &h, NULL);
            if (st == KVA_ERR_NOMEM) {
                w->nomem++;
                continue;
            }
            TCHECK_STATUS(st, KVA_OK);
            if (st != KVA_OK) continue;
            w->allocations++;
            seqs[n] = h;
            tokens[n++] = t;
        } else if (what < 7 && n > 0) {
            int i = (int)rnd(&r, (uint32_t)n);
            uint32_t more = 1 + rnd(&r, 64);
            if (tokens[i] + more > 1024) continue;
            kva_kv_copy copy;
            kva_status st = kva_kv_seq_append(w->kv, seqs[i], more, &copy);
            if (st == KVA_ERR_NOMEM) {
                w->nomem++;
                continue;
            }
            TCHECK_STATUS(st, KVA_OK);
            if (st != KVA_OK) continue;
            w->appends++;
            if (copy.dst) {
                w->moves++;
                TCHECK(copy.tokens == tokens[i] && copy.dst_bucket >= tokens[i] + more);
            }
            tokens[i] += more;
            kva_kv_seq_info info;
            TCHECK_STATUS(kva_kv_seq_get_info(w->kv, seqs[i], &info), KVA_OK);
            TCHECK(info.num_tokens == tokens[i] && info.bucket_tokens >= tokens[i] && info.buffer != NULL);
        } else if (n > 0) {
            int i = (int)rnd(&r, (uint32_t)n);
            TCHECK_STATUS(kva_kv_seq_free(w->kv, seqs[i]), KVA_OK);
            w->frees++;
            seqs[i] = seqs[--n];
            tokens[i] = tokens[n];
        }
    }
    for (int i = 0; i < n; i++) {
        TCHECK_STATUS(kva_kv_seq_free(w->kv, seqs[i]), KVA_OK);
        w->frees++;
    }
    return NULL;
}

static void test_contiguous(void) {
    kva_kv_config cfg = small_config(0, 16);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.capacity_bytes = (size_t)4 << 20; /* 96 B per token: about 43,000 tokens */
    cfg.max_context = 1024;
    cfg.trace = 1;
    kva_kv *kv = make_cache(&cfg);
    contig_worker workers[CONTIG_THREADS];
    pthread_t threads[CONTIG_THREADS];
    for (int i = 0; i < CONTIG_THREADS; i++) {
        workers[i] = (contig_worker){.kv = kv, .id = i, .ops = 10000u * (uint32_t)scale};
        REQUIRE(pthread_create(&threads[i], NULL, contig_worker_main, &workers[i]) == 0);
    }
    for (int i = 0; i < CONTIG_THREADS; i++) pthread_join(threads[i], NULL);

    uint64_t allocations = 0, frees = 0, appends = 0, moves = 0, nomem = 0;
    for (int i = 0; i < CONTIG_THREADS; i++) {
        allocations += workers[i].allocations;
        frees += workers[i].frees;
        appends += workers[i].appends;
        moves += workers[i].moves;
        nomem += workers[i].nomem;
    }
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_stats st = stats(kv);
    CHECK(st.sequences == 0 && st.bytes_in_use == 0);
    CHECK(st.allocations == allocations && st.frees == frees && st.appends == appends);
    CHECK(st.moves == moves && moves > 0);
    CHECK(st.alloc_failures == nomem);
    CHECK(st.timed_calls > 0);
    kva_kv_info info;
    CHECK_STATUS(kva_kv_get_info(kv, &info), KVA_OK);
    kva_stats ps;
    CHECK_STATUS(kva_get_stats(info.pool, &ps), KVA_OK);
    CHECK(ps.live_allocations == 0);
    CHECK_STATUS(kva_check(info.pool), KVA_OK);
    kva_kv_destroy(kv);
}

/* ------------------------------------------------------------------------------------------ */
/* VarPool                                                                                    */
/* ------------------------------------------------------------------------------------------ */

#define VAR_THREADS 4
#define VAR_LIVE 48
#define VAR_CAPACITY ((size_t)4 << 20)

typedef struct var_worker {
    kva_var *var;
    int id;
    uint32_t ops;
    uint64_t allocs, frees, nomem, rejected;
} var_worker;

static int var_done;

static uint64_t stamp_of(int id, void *p, size_t size) {
    return ((uint64_t)(id + 1) << 56) ^ (uint64_t)(uintptr_t)p ^ ((uint64_t)size << 20);
}

static void *var_worker_main(void *arg) {
    var_worker *w = arg;
    rng r = {0x2545f4914f6cdd1dull * (uint64_t)(w->id + 1)};
    void *ptrs[VAR_LIVE];
    size_t sizes[VAR_LIVE];
    int n = 0;
    for (uint32_t op = 0; op < w->ops; op++) {
        uint32_t what = rnd(&r, 100);
        if (what < 50 && n < VAR_LIVE) {
            /* Mostly small, now and then large. */
            size_t size = rnd(&r, 8) ? 16 + rnd(&r, 8192) : 16 + rnd(&r, 256 * 1024); /* two stamps fit */
            void *p = NULL;
            kva_status st = kva_var_alloc(w->var, size, &p);
            if (st == KVA_ERR_NOMEM) {
                TCHECK(p == NULL);
                w->nomem++;
                continue;
            }
            TCHECK_STATUS(st, KVA_OK);
            if (st != KVA_OK) continue;
            w->allocs++;
            uint64_t stamp = stamp_of(w->id, p, size);
            memcpy(p, &stamp, sizeof stamp);
            memcpy((char *)p + size - sizeof stamp, &stamp, sizeof stamp);
            ptrs[n] = p;
            sizes[n++] = size;
        } else if (what < 92 && n > 0) {
            int i = (int)rnd(&r, (uint32_t)n);
            void *p = ptrs[i];
            size_t size = sizes[i];
            uint64_t want = stamp_of(w->id, p, size), head, tail;
            memcpy(&head, p, sizeof head);
            memcpy(&tail, (char *)p + size - sizeof tail, sizeof tail);
            TCHECK(head == want && tail == want);
            size_t usable = kva_var_usable_size(w->var, p);
            TCHECK(usable >= size && usable < size + 256);
            if (usable > 256) {
                /* Inside a live range of this thread: refused, nothing changes. */
                TCHECK_STATUS(kva_var_free(w->var, (char *)p + 256), KVA_ERR_BAD_POINTER);
                w->rejected++;
            }
            TCHECK_STATUS(kva_var_free(w->var, p), KVA_OK);
            w->frees++;
            ptrs[i] = ptrs[--n];
            sizes[i] = sizes[n];
        } else {
            void *p = (void *)1;
            TCHECK_STATUS(kva_var_alloc(w->var, 0, &p), KVA_ERR_INVALID);
            TCHECK(p == (void *)1 && strstr(kva_last_error(), "size 0") != NULL);
            TCHECK_STATUS(kva_var_free(w->var, NULL), KVA_ERR_INVALID);
            w->rejected += 2;
        }
    }
    for (int i = 0; i < n; i++) {
        TCHECK_STATUS(kva_var_free(w->var, ptrs[i]), KVA_OK);
        w->frees++;
    }
    return NULL;
}

static void *var_checker_main(void *arg) {
    kva_var *var = arg;
    while (!done_flag(&var_done)) {
        TCHECK_STATUS(kva_var_check(var), KVA_OK);
        kva_var_stats st;
        TCHECK_STATUS(kva_var_get_stats(var, &st), KVA_OK);
        TCHECK(st.bytes_used + st.bytes_free == st.capacity);
        TCHECK(st.internal_waste == st.bytes_used - st.bytes_requested);
        TCHECK(st.live_allocations == st.alloc_count - st.free_count);
        TCHECK(st.largest_free <= st.bytes_free);
        usleep(300);
    }
    return NULL;
}

static void test_varpool(kva_var_policy policy) {
    kva_var_config cfg;
    kva_var_config_init(&cfg);
    cfg.capacity = VAR_CAPACITY;
    cfg.policy = policy;
    cfg.pages = KVA_PAGES_SMALL;
    kva_var *var = NULL;
    REQUIRE(kva_var_create(&cfg, NULL, &var) == KVA_OK);
    var_worker workers[VAR_THREADS];
    pthread_t threads[VAR_THREADS], checker;
    var_done = 0;
    for (int i = 0; i < VAR_THREADS; i++) {
        workers[i] = (var_worker){.var = var, .id = i, .ops = 20000u * (uint32_t)scale};
        REQUIRE(pthread_create(&threads[i], NULL, var_worker_main, &workers[i]) == 0);
    }
    REQUIRE(pthread_create(&checker, NULL, var_checker_main, var) == 0);
    for (int i = 0; i < VAR_THREADS; i++) pthread_join(threads[i], NULL);
    __atomic_store_n(&var_done, 1, __ATOMIC_RELEASE);
    pthread_join(checker, NULL);

    uint64_t allocs = 0, frees = 0, nomem = 0, rejected = 0;
    for (int i = 0; i < VAR_THREADS; i++) {
        allocs += workers[i].allocs;
        frees += workers[i].frees;
        nomem += workers[i].nomem;
        rejected += workers[i].rejected;
    }
    CHECK_STATUS(kva_var_check(var), KVA_OK);
    kva_var_stats st;
    CHECK_STATUS(kva_var_get_stats(var, &st), KVA_OK);
    CHECK(st.alloc_count == allocs && st.free_count == frees && allocs == frees);
    CHECK(st.live_allocations == 0);
    CHECK(st.bytes_used == 0 && st.bytes_requested == 0);
    CHECK(st.bytes_free == st.capacity && st.largest_free == st.capacity && st.free_ranges == 1);
    CHECK(st.alloc_failures == nomem);
    CHECK(st.rejected_calls == rejected);
    CHECK(allocs > 0);
    kva_var_destroy(var);
}

int main(int argc, char **argv) {
    if (argc > 1) scale = atoi(argv[1]) > 0 ? atoi(argv[1]) : 1;
    test_paged(0);
    test_paged(1);
    test_contiguous();
    test_varpool(KVA_VAR_TLSF);
    test_varpool(KVA_VAR_FIRST_FIT);
    test_varpool(KVA_VAR_BEST_FIT);
    test_varpool(KVA_VAR_WORST_FIT);
    thread_failures_merge();
    return CHECK_DONE();
}
