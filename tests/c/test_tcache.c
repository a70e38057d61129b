/*
 * test_tcache.c — the edges of thread caches: owner ids are reused and never wrap into "no
 * owner"; a thread with no cache that makes a refused free gets none (a refused call changes
 * nothing), and one that cannot get a cache still frees; a thread that only frees a class keeps
 * at most one word of it; one that allocates and frees keeps up to its class's word limit, dry
 * words included, so a batch that fits cycles through the same words, while one that only
 * allocates gives its dry words back; the free window covers the run
 * of words a cache owns and refuses, exactly as the full path does, what is not a live object
 * of it.
 */
#include <semaphore.h>
#include <unistd.h>
#include <string.h>

#include "pool.h"
#include "pool_fingerprint.h"
#include "tcache.h"
#include "thread_util.h"

#define MiB ((size_t)1 << 20)

static kva_pool *pool;

static kva_pool *make_pool(size_t capacity) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.arenas = 2;
    kva_pool *p = NULL;
    REQUIRE(kva_pool_create(&cfg, &p) == KVA_OK);
    return p;
}

static kva_stats stats(void) {
    kva_stats st;
    REQUIRE(kva_get_stats(pool, &st) == KVA_OK);
    return st;
}

/* ---- ids ---------------------------------------------------------------------------------- */

static void *alloc_free_some(void *arg) {
    (void)arg;
    void *p[100];
    for (int i = 0; i < 100; i++) TCHECK_STATUS(kva_alloc(pool, 48, &p[i]), KVA_OK);
    for (int i = 0; i < 100; i++) TCHECK_STATUS(kva_free(pool, p[i]), KVA_OK);
    return NULL;
}

static void run_one(void *(*fn)(void *), void *arg) {
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, fn, arg) == 0);
    pthread_join(t, NULL);
    thread_failures_merge();
}

static void test_ids_are_reused(void) {
    pool = make_pool(64 * MiB);
    for (int i = 0; i < 200; i++) run_one(alloc_free_some, NULL);
    /* One thread at a time: every cache took the id the previous one gave back. */
    CHECK(pool->caches.next_id == 1);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* A thread that finds every id taken gets no cache: it cannot allocate small objects, it still
 * frees them (into the word under the arena lock, or to its owner), and the pool stays whole. */
typedef struct uncached_job {
    void *to_free[3]; /* one in a word nobody owns, one in a word the main thread owns, one twice */
} uncached_job;

static void *free_without_cache(void *arg) {
    uncached_job *job = arg;
    void *p = NULL;
    TCHECK_STATUS(kva_alloc(pool, 64, &p), KVA_ERR_NOMEM);
    TCHECK(p == NULL && strstr(kva_last_error(), "cache") != NULL);
    for (int i = 0; i < 3; i++) TCHECK_STATUS(kva_free(pool, job->to_free[i]), KVA_OK);
    TCHECK_STATUS(kva_free(pool, job->to_free[2]), KVA_ERR_DOUBLE_FREE);
    TCHECK_STATUS(kva_free(pool, job->to_free[0]), KVA_ERR_DOUBLE_FREE);
    return NULL;
}

static void test_ids_exhausted(void) {
    pool = make_pool(64 * MiB);
    void *objs[200];
    for (int i = 0; i < 200; i++) CHECK_STATUS(kva_alloc(pool, 64, &objs[i]), KVA_OK);
    kva_tcache *mine = kva_tc_find(pool);
    REQUIRE(mine != NULL && mine->id == 1);
    pool->caches.next_id = UINT32_MAX; /* as if 2^32 - 1 ids were out and none given back */
    /* objs[0] lies in a word the main thread gave back when it moved on (nobody owns it);
     * objs[199] in its current word. */
    uncached_job job = {{objs[0], objs[199], objs[100]}};
    uint64_t frees_before = stats().free_count;
    run_one(free_without_cache, &job);
    kva_stats st = stats();
    CHECK(st.thread_caches == 1 && st.free_count == frees_before + 3 && st.live_allocations == 197);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_free(pool, objs[199]), KVA_ERR_DOUBLE_FREE); /* freed remotely, merged or not */
    for (int i = 1; i < 199; i++)
        if (i != 100) CHECK_STATUS(kva_free(pool, objs[i]), KVA_OK);
    CHECK(stats().live_allocations == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* ---- refused frees make no cache ----------------------------------------------------------- */

typedef struct refused_job {
    void *freed_twice, *inside;
    snapshot before;
} refused_job;

static void *refused_frees(void *arg) {
    refused_job *job = arg;
    TCHECK_STATUS(kva_free(pool, job->freed_twice), KVA_ERR_DOUBLE_FREE);
    TCHECK_STATUS(kva_free(pool, job->inside), KVA_ERR_BAD_POINTER);
    TCHECK(kva_tc_find(pool) == NULL);
    return NULL;
}

static void test_refused_free_makes_no_cache(void) {
    pool = make_pool(64 * MiB);
    void *a, *b;
    CHECK_STATUS(kva_alloc(pool, 256, &a), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 256, &b), KVA_OK);
    CHECK_STATUS(kva_free(pool, a), KVA_OK);
    refused_job job = {.freed_twice = a, .inside = (char *)b + 8, .before = take(pool)};
    run_one(refused_frees, &job);
    CHECK(unchanged(pool, &job.before)); /* thread_caches and metadata_bytes included */
    CHECK_STATUS(kva_free(pool, b), KVA_OK);
    kva_pool_destroy(pool);
}

/* ---- a thread that only frees -------------------------------------------------------------- */

typedef struct consumer_job {
    void **objs;
    int count;
    size_t cached_bytes;
} consumer_job;

static void *consume(void *arg) {
    consumer_job *job = arg;
    for (int i = 0; i < job->count; i++) TCHECK_STATUS(kva_free(pool, job->objs[i]), KVA_OK);
    kva_tcache *tc = kva_tc_find(pool);
    TCHECK(tc != NULL && tc->cls[kva_class_index(1024)].nowned <= 1);
    kva_stats st;
    kva_get_stats(pool, &st);
    job->cached_bytes = st.cached_bytes;
    return NULL;
}

static void test_free_only_thread_keeps_one_word(void) {
    pool = make_pool(64 * MiB);
    enum {
        N = 512
    };
    void *objs[N];
    for (int i = 0; i < N; i++) CHECK_STATUS(kva_alloc(pool, 1024, &objs[i]), KVA_OK);
    kva_thread_flush(pool); /* the main thread holds no free 1 KiB object */
    consumer_job job = {.objs = objs, .count = N};
    run_one(consume, &job);
    /* While it ran, the consumer held at most one word of 64 objects of 1 KiB. */
    CHECK(job.cached_bytes <= 64 * 1024);
    CHECK(stats().live_allocations == 0 && stats().cached_bytes == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* 64 B objects: 32 words (128 KiB of span); 1 KiB objects: the minimum, 4 words. */
static void check_word_limit(size_t size, uint32_t limit) {
    pool = make_pool(64 * MiB);
    enum {
        N = 3000
    };
    static void *objs[N];
    unsigned c = kva_class_index(size);
    for (int i = 0; i < N; i++) CHECK_STATUS(kva_alloc(pool, size, &objs[i]), KVA_OK);
    /* A thread that has freed nothing gives its dry words back: it keeps the current one. */
    kva_tc_class *k = &kva_tc_find(pool)->cls[c];
    CHECK(k->limit == limit && k->nowned == 1);
    /* Its frees claim the words they land in, up to the limit. */
    for (int i = 0; i < N; i++) CHECK_STATUS(kva_free(pool, objs[i]), KVA_OK);
    CHECK(k->nowned == limit && stats().cached_bytes <= (uint64_t)limit * 64 * size);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    /* A batch of the limit's objects, twice: the second uses exactly the words of the first. */
    uint32_t batch = limit * 64, slab[KVA_TC_WORDS], word[KVA_TC_WORDS];
    for (int round = 0; round < 2; round++) {
        for (uint32_t i = 0; i < batch; i++) CHECK_STATUS(kva_alloc(pool, size, &objs[i]), KVA_OK);
        if (round == 0) {
            memcpy(slab, k->slab, sizeof slab);
            memcpy(word, k->word, sizeof word);
        } else {
            CHECK(memcmp(slab, k->slab, limit * sizeof *slab) == 0 && memcmp(word, k->word, limit * sizeof *word) == 0);
        }
        for (uint32_t i = 0; i < batch; i++) CHECK_STATUS(kva_free(pool, objs[i]), KVA_OK);
    }
    CHECK(k->nowned == limit);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* A thread that allocates a class and frees only other threads' objects of it (remote frees,
 * none into its own words) is a producer all the same: it keeps just its current word. */
typedef struct remote_producer_job {
    void **foreign; /* objects of the main thread's cache, freed here now and then */
    int nforeign;
    uint32_t nowned;
} remote_producer_job;

static void *produce_and_free_remotely(void *arg) {
    remote_producer_job *job = arg;
    static void *mine[3000];
    for (int i = 0; i < 3000; i++) {
        TCHECK_STATUS(kva_alloc(pool, 64, &mine[i]), KVA_OK);
        if (i % 15 == 0 && i / 15 < job->nforeign) TCHECK_STATUS(kva_free(pool, job->foreign[i / 15]), KVA_OK);
    }
    job->nowned = kva_tc_find(pool)->cls[kva_class_index(64)].nowned;
    for (int i = 0; i < 3000; i++) TCHECK_STATUS(kva_free(pool, mine[i]), KVA_OK);
    return NULL;
}

static void test_remote_frees_make_no_keeper(void) {
    pool = make_pool(64 * MiB);
    static void *foreign[200];
    /* A round first, so that the main thread keeps its words: the second round's objects all
     * lie in words it owns, and every free of them by the other thread is a remote one. */
    for (int i = 0; i < 200; i++) CHECK_STATUS(kva_alloc(pool, 64, &foreign[i]), KVA_OK);
    for (int i = 0; i < 200; i++) CHECK_STATUS(kva_free(pool, foreign[i]), KVA_OK);
    for (int i = 0; i < 200; i++) CHECK_STATUS(kva_alloc(pool, 64, &foreign[i]), KVA_OK);
    kva_tc_class *k = &kva_tc_find(pool)->cls[kva_class_index(64)];
    REQUIRE(k->nowned == 4);
    remote_producer_job job = {.foreign = foreign, .nforeign = 200};
    run_one(produce_and_free_remotely, &job);
    CHECK(job.nowned == 1);
    CHECK(stats().live_allocations == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

static void test_allocating_thread_keeps_its_limit(void) {
    check_word_limit(64, KVA_TC_WORDS);
    check_word_limit(1024, KVA_TC_MIN_WORDS);
}

/* ---- the free window ----------------------------------------------------------------------- */

static void *free_remotely(void *arg) {
    TCHECK_STATUS(kva_free(pool, arg), KVA_OK);
    return NULL;
}

static void test_free_window(void) {
    pool = make_pool(64 * MiB);
    enum {
        N = 1000
    };
    static void *objs[N];
    /* Round 1: the thread gives its dry words back as it allocates (it has freed nothing), so
     * it owns only the current word, the last 40 objects' (960 .. 999 of a word of 64). */
    for (int i = 0; i < N; i++) CHECK_STATUS(kva_alloc(pool, 64, &objs[i]), KVA_OK);
    kva_tcache *tc = kva_tc_find(pool);
    kva_tc_window *win = kva_tc_window_of(tc, (uintptr_t)objs[999]);
    /* The first fast free only notes its slab; the second there opens the window on the run of
     * owned words around it, here that one word. */
    CHECK_STATUS(kva_free(pool, objs[999]), KVA_OK);
    CHECK(win->span == 0);
    CHECK_STATUS(kva_free(pool, objs[998]), KVA_OK);
    CHECK(win->span == 64 * 64 && win->base == (uintptr_t)objs[999] - 39 * 64);
    for (int i = 0; i < 998; i++) CHECK_STATUS(kva_free(pool, objs[i]), KVA_OK);
    /* Round 2: a thread that frees keeps its dry words, so the objects lie in the 16 words it
     * claimed as it freed; two frees put the window on all of them. */
    for (int i = 0; i < N; i++) CHECK_STATUS(kva_alloc(pool, 64, &objs[i]), KVA_OK);
    CHECK_STATUS(kva_free(pool, objs[500]), KVA_OK);
    CHECK_STATUS(kva_free(pool, objs[501]), KVA_OK);
    win = kva_tc_window_of(tc, (uintptr_t)objs[501]);
    unsigned char *first = (unsigned char *)win->base;
    CHECK(win->span == 16 * 64 * 64);
    for (int i = 0; i < N; i++) CHECK((uintptr_t)objs[i] - win->base < win->span);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    /* Inside the window, each refusal is the full path's and changes nothing. */
    uint64_t frees = tc->frees[kva_class_index(64)];
    CHECK_STATUS(kva_free(pool, objs[500]), KVA_ERR_DOUBLE_FREE);
    CHECK_STATUS(kva_free(pool, first + 64 * 700 + 8), KVA_ERR_BAD_POINTER); /* inside an object */
    unsigned char *unallocated = NULL; /* one of the run's 24 objects not handed out */
    for (int j = 0; j < 16 * 64 && !unallocated; j++) {
        int handed_out = 0;
        for (int i = 0; i < N; i++) handed_out |= objs[i] == first + 64 * j;
        if (!handed_out) unallocated = first + 64 * j;
    }
    CHECK_STATUS(kva_free(pool, unallocated), KVA_ERR_DOUBLE_FREE);
    CHECK(tc->frees[kva_class_index(64)] == frees);
    /* An object freed by another thread (a remote free) and then again by its owner. */
    run_one(free_remotely, objs[600]); /* word 9 of the run, not its first */
    CHECK_STATUS(kva_free(pool, objs[600]), KVA_ERR_DOUBLE_FREE);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    /* Every other object frees through the window; all of them are free afterwards. */
    for (int i = 0; i < N; i++)
        if (i != 500 && i != 501 && i != 600) CHECK_STATUS(kva_free(pool, objs[i]), KVA_OK);
    CHECK(stats().live_allocations == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    /* Giving the words back closes the window; the objects are then refused the slow way. */
    kva_thread_flush(pool);
    CHECK(win->span == 0);
    CHECK_STATUS(kva_free(pool, objs[3]), KVA_ERR_DOUBLE_FREE);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* ---- two frees that raced ------------------------------------------------------------------ */

/* The state two racing frees of one object leave when both are accepted (reliability.md, "Known
 * limits"): the owner's free set the object's bit in its word (and counted it) while another
 * thread's free, missing that store, set the object's remote bit (counted where it is merged).
 * The owner must not hand the object out again while that remote bit stands, or the bit's merge
 * would free the live object and hand it out twice; and the merge must not count the bit, whose
 * object is free already. */
static void test_raced_double_free_is_not_handed_out_twice(void) {
    pool = make_pool(64 * MiB);
    enum {
        FIRST = 10,
        MORE = 300
    };
    static void *objs[FIRST + MORE];
    for (int i = 0; i < FIRST; i++) CHECK_STATUS(kva_alloc(pool, 64, &objs[i]), KVA_OK);
    CHECK_STATUS(kva_free(pool, objs[5]), KVA_OK); /* the owner's free: a plain store */
    kva_object_ref ref;
    REQUIRE(kva_slab_locate(&pool->slabs, (uint64_t)((unsigned char *)objs[5] - pool->base), &ref));
    kva_tcache *tc = kva_tc_find(pool);
    REQUIRE(tc && kva_slab_owner_of(&pool->slabs, &ref) == tc->id);
    __atomic_fetch_or(kva_ref_remote(&pool->slabs, &ref), ref.bit, __ATOMIC_SEQ_CST); /* the other free */
    CHECK(stats().live_allocations == FIRST - 1); /* the remote bit is not counted twice */
    objs[5] = NULL;
    /* Past the next merge of the word (it runs dry after 55 more) and beyond: every object
     * handed out is distinct from every other live one; objs[5]'s place comes back once. */
    for (int i = FIRST; i < FIRST + MORE; i++) CHECK_STATUS(kva_alloc(pool, 64, &objs[i]), KVA_OK);
    int duplicates = 0;
    for (int i = 0; i < FIRST + MORE; i++)
        for (int j = i + 1; j < FIRST + MORE; j++) duplicates += objs[i] && objs[i] == objs[j];
    CHECK(duplicates == 0);
    CHECK(stats().live_allocations == FIRST - 1 + MORE); /* the second free never counted */
    CHECK_STATUS(kva_check(pool), KVA_OK);
    for (int i = 0; i < FIRST + MORE; i++)
        if (objs[i]) CHECK_STATUS(kva_free(pool, objs[i]), KVA_OK);
    CHECK(stats().live_allocations == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* ---- steps placed in another thread's window (kva_tc_test_hook) ----------------------------- */

/* Two threads in turn: the hook's thread posts `arrived` and waits for `resume`, while the
 * other does its step. */
static sem_t arrived, resume;
static int hook_point = -1;

static void pause_at_point(int point, void *ctx) {
    (void)ctx;
    if (point != hook_point) return;
    hook_point = -1; /* once */
    sem_post(&arrived);
    sem_wait(&resume);
}

/* An 8 MiB pool of base pages with one arena, so that a chunk a slab leaves is the one the
 * next slab takes. */
#define ONE_ARENA_CAPACITY (8 * MiB)
static void make_one_arena_pool(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = ONE_ARENA_CAPACITY;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.arenas = 1;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
}

/* Starts a thread running fn(arg) and returns once it has paused at `point`. */
static pthread_t start_paused(void *(*fn)(void *), void *arg, int point) {
    REQUIRE(sem_init(&arrived, 0, 0) == 0 && sem_init(&resume, 0, 0) == 0);
    hook_point = point;
    kva_tc_test_hook(pause_at_point, NULL);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, fn, arg) == 0);
    sem_wait(&arrived);
    return t;
}

/* Lets the paused thread go on, waits for it and removes the hook. */
static void finish_paused(pthread_t t) {
    sem_post(&resume);
    pthread_join(t, NULL);
    kva_tc_test_hook(NULL, NULL);
    thread_failures_merge();
    sem_destroy(&arrived);
    sem_destroy(&resume);
}

/* A remote free passes its object on with an atomic OR; from then on the owner may merge it,
 * the slab empty, and a slab of another class be made in the chunk, whose words lie where the
 * old slab's did. The free must not then touch them: a re-read of the object's old bit there
 * would find one of the new slab's free bits, and clearing it to take back a racing double free
 * would lose an object of the new slab and refuse a valid free. */
static void *free_x(void *arg) {
    TCHECK_STATUS(kva_free(pool, arg), KVA_OK);
    return NULL;
}

static void test_remote_free_outlived_by_its_slab(void) {
    make_one_arena_pool();
    void *x, *y;
    CHECK_STATUS(kva_alloc(pool, 4096, &x), KVA_OK); /* in a word this thread owns */
    pthread_t t = start_paused(free_x, x, KVA_TC_POINT_PASSED);
    /* The other thread has passed x on. Its word goes back (x merged: the slab is empty), the
     * empty slab to the buddy, and a 64 B slab is made in the same chunk, its objects free. */
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 64, &y), KVA_OK);
    REQUIRE(((uintptr_t)y - (uintptr_t)pool->base) >> pool->slabs.chunk_shift ==
            ((uintptr_t)x - (uintptr_t)pool->base) >> pool->slabs.chunk_shift);
    CHECK_STATUS(kva_free(pool, y), KVA_OK);
    finish_paused(t);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_stats st = stats();
    CHECK(st.live_allocations == 0);
    /* Every 64 B object of the pool can be had: none was lost. */
    size_t n = 0;
    void *p;
    while (kva_alloc(pool, 64, &p) == KVA_OK) n++;
    CHECK(n == ONE_ARENA_CAPACITY / 64);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* A remote free's object may be merged by its owner, handed out again and freed by a third
 * thread, all before the first free returns. The first free stands: a re-read would find the
 * object's bit free, and taking "its" remote bit back to refuse itself as a racing double free
 * would take the third thread's, refusing a valid free and losing another (the live count one
 * high for good). The steps, placed: R frees x and pauses just after passing it on; this thread
 * (x's owner) frees y in x's word, which merges x, holds the arena lock, lets R go on,
 * allocates x again and has G free it. */
static kva_status late_status; /* what the paused thread's free returned */
static void *free_x_late(void *arg) {
    late_status = kva_free(pool, arg);
    return NULL;
}

static void test_a_remote_free_outlived_by_its_object_stands(void) {
    make_one_arena_pool();
    void *x, *y, *again;
    CHECK_STATUS(kva_alloc(pool, 64, &x), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 64, &y), KVA_OK); /* the same word: this thread's */
    pthread_t r = start_paused(free_x_late, x, KVA_TC_POINT_PASSED);
    CHECK_STATUS(kva_free(pool, y), KVA_OK); /* merges x's remote bit: x is free in the word */
    pthread_mutex_lock(&pool->slabs.arenas[0].lock);
    sem_post(&resume);
    usleep(100000); /* R returns, or waits for the lock where the take-back did */
    CHECK_STATUS(kva_alloc(pool, 64, &again), KVA_OK);
    CHECK(again == x); /* x's next life */
    pthread_t g;
    REQUIRE(pthread_create(&g, NULL, free_x, again) == 0);
    pthread_join(g, NULL);
    pthread_mutex_unlock(&pool->slabs.arenas[0].lock);
    pthread_join(r, NULL);
    kva_tc_test_hook(NULL, NULL);
    thread_failures_merge();
    sem_destroy(&arrived);
    sem_destroy(&resume);
    CHECK(late_status == KVA_OK); /* the only free of x's first life */
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    CHECK(stats().live_allocations == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* A remote free checks that its object is live, then passes it on with an atomic OR. Between
 * the two, a racing free of the same object by its owner may empty the slab and the slab go
 * back to the buddy: the OR then lands in a dead slab's words, where no merge will ever find
 * it, and the free is accepted. Counted as a free, it would leave the class one more free than
 * allocations (kva_check S5); a remote free is counted where its bit is merged, and this one is
 * merged nowhere. */
static void test_racing_free_lands_in_a_released_slab(void) {
    make_one_arena_pool();
    void *x;
    CHECK_STATUS(kva_alloc(pool, 4096, &x), KVA_OK); /* in a word this thread owns */
    pthread_t t = start_paused(free_x_late, x, KVA_TC_POINT_PASSING);
    /* The other thread found x live and is about to pass it on. The owner frees x first, gives
     * its word back and trims: the slab, empty, goes back to the buddy. */
    CHECK_STATUS(kva_free(pool, x), KVA_OK);
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(pool->slabs.live_slabs == 0);
    finish_paused(t);
    /* The late free may be accepted (a racing double free: reliability.md, "Known limits"), but
     * it frees nothing more and counts nothing. */
    CHECK(late_status == KVA_OK || late_status == KVA_ERR_DOUBLE_FREE);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK(stats().live_allocations == 0);
    CHECK(stats().free_count == stats().alloc_count);
    /* The chunk is a slab again, of 4 KiB objects: all of them can be had, once each. */
    size_t n = 0;
    void *p;
    while (kva_alloc(pool, 4096, &p) == KVA_OK) n++;
    CHECK(n == ONE_ARENA_CAPACITY / 4096);
    CHECK(stats().live_allocations == n);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* The same late free, but the chunk is made a slab again, of 32 KiB objects, whose bitmap words
 * lie where the 64 KiB slab's did, and its object is live in a word nobody owns: the late free's
 * bit frees it there (a racing double free: reliability.md, "Known limits"), and the drain that
 * does so must count the free under the class it frees, 32 KiB, not the late free's, 64 KiB, or
 * both classes' counts would be wrong (S5). */
static void test_late_free_drained_in_another_class(void) {
    make_one_arena_pool();
    unsigned big = (unsigned)kva_size_class_of(65536), half = (unsigned)kva_size_class_of(32768);
    REQUIRE(pool->slabs.geom[big].l0_words == pool->slabs.geom[half].l0_words &&
            pool->slabs.geom[big].l1_words == pool->slabs.geom[half].l1_words);
    void *x, *y;
    CHECK_STATUS(kva_alloc(pool, 65536, &x), KVA_OK);
    pthread_t t = start_paused(free_x_late, x, KVA_TC_POINT_PASSING);
    CHECK_STATUS(kva_free(pool, x), KVA_OK);
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 32768, &y), KVA_OK);
    REQUIRE(y == x);                              /* the first object of the same chunk: the late free's bit is y's */
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK); /* y live in a word nobody owns */
    finish_paused(t);
    CHECK(late_status == KVA_OK || late_status == KVA_ERR_DOUBLE_FREE);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_class_stats cs;
    CHECK_STATUS(kva_get_class_stats(pool, big, &cs), KVA_OK);
    CHECK(cs.live_objects == 0);
    /* y was freed by the late free or it was not, and the counts say which. */
    uint64_t y_live = (kva_usable_size(pool, y) != 0);
    CHECK_STATUS(kva_get_class_stats(pool, half, &cs), KVA_OK);
    CHECK(cs.live_objects == y_live);
    CHECK(stats().live_allocations == y_live);
    kva_pool_destroy(pool);
}

/* A free into a word nobody owns checks under the arena lock that its object is live, then
 * claims the word, merging the remote bits waiting there. A remote free of the same object that
 * found the word still owned may pass its bit on in between (a racing double free): the claim
 * then merges that bit, and must not count it beside the free it is making, or the one object
 * would be counted free twice. The remote free's thread is placed by the test points:
 * it pauses before its OR; the owner gives the word back and frees the object, and pauses in the
 * claim, lock held, until the other thread's OR has landed. */
static __thread int is_late_thread;
static sem_t passed;

static void claim_race(int point, void *ctx) {
    (void)ctx;
    if (is_late_thread && point == KVA_TC_POINT_PASSING) {
        sem_post(&arrived);
        sem_wait(&resume);
    } else if (is_late_thread && point == KVA_TC_POINT_PASSED) {
        sem_post(&passed);
    } else if (!is_late_thread && point == KVA_TC_POINT_CLAIMING) {
        sem_post(&resume);
        sem_wait(&passed);
    }
}

static void *free_late_marked(void *arg) {
    is_late_thread = 1;
    late_status = kva_free(pool, arg);
    return NULL;
}

static void test_claim_racing_a_remote_free_counts_once(void) {
    pool = make_pool(64 * MiB);
    void *x;
    CHECK_STATUS(kva_alloc(pool, 64, &x), KVA_OK); /* in a word this thread owns */
    REQUIRE(sem_init(&arrived, 0, 0) == 0 && sem_init(&resume, 0, 0) == 0 && sem_init(&passed, 0, 0) == 0);
    kva_tc_test_hook(claim_race, NULL);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, free_late_marked, x) == 0);
    sem_wait(&arrived);                           /* the other thread found x live and owned */
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK); /* the word goes back: nobody owns it */
    CHECK_STATUS(kva_free(pool, x), KVA_OK);      /* claims it; the other OR lands in the claim */
    pthread_join(t, NULL);
    kva_tc_test_hook(NULL, NULL);
    thread_failures_merge();
    CHECK(late_status == KVA_OK || late_status == KVA_ERR_DOUBLE_FREE);
    kva_stats st = stats();
    CHECK(st.live_allocations == 0 && st.free_count == st.alloc_count && st.alloc_count == 1);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_free(pool, x), KVA_ERR_DOUBLE_FREE);
    kva_pool_destroy(pool);
    sem_destroy(&arrived);
    sem_destroy(&resume);
    sem_destroy(&passed);
}

/* A pool's destruction marks each of its caches dead, and a marked cache's thread may free it
 * at any moment, on its next lookup. The destruction reads each cache's successor before
 * marking it: read after, it would come from freed memory, which the program may have been
 * given back meanwhile (here zeroed by calloc), and the walk would stop early, leaving later
 * caches of the dead pool unmarked. */
static kva_pool *other;
static kva_tcache *idle_cache; /* the idle thread's cache of `pool` */
static sem_t idle_done;

static void *use_then_idle(void *arg) {
    (void)arg;
    void *p;
    TCHECK_STATUS(kva_alloc(pool, 64, &p), KVA_OK);
    TCHECK_STATUS(kva_free(pool, p), KVA_OK);
    idle_cache = kva_tc_find(pool);
    sem_post(&arrived);
    sem_wait(&idle_done); /* idle while the pool is destroyed */
    return NULL;
}

static void *use_both_then_drop(void *arg) {
    (void)arg;
    void *p;
    TCHECK_STATUS(kva_alloc(other, 64, &p), KVA_OK);
    TCHECK_STATUS(kva_free(other, p), KVA_OK);
    TCHECK_STATUS(kva_alloc(pool, 64, &p), KVA_OK); /* its cache of `pool`: first in the pool's list */
    TCHECK_STATUS(kva_free(pool, p), KVA_OK);
    sem_post(&arrived);
    sem_wait(&resume); /* the destruction has marked this thread's cache of `pool` */
    /* A call on `other` looks the thread's caches up and frees the dead one; then memory of
     * its size is taken again. */
    TCHECK_STATUS(kva_alloc(other, 64, &p), KVA_OK);
    TCHECK_STATUS(kva_free(other, p), KVA_OK);
    void *again = calloc(1, sizeof(kva_tcache));
    sem_post(&arrived);
    sem_wait(&resume);
    free(again);
    return NULL;
}

static void after_mark(int point, void *ctx) {
    (void)ctx;
    if (point != KVA_TC_POINT_MARKED || hook_point != KVA_TC_POINT_MARKED) return;
    hook_point = -1; /* at the first cache marked, the dropping thread's */
    sem_post(&resume);
    sem_wait(&arrived);
}

static void test_destroy_outlived_by_a_cache(void) {
    pool = make_pool(16 * MiB);
    other = make_pool(16 * MiB);
    REQUIRE(sem_init(&arrived, 0, 0) == 0 && sem_init(&resume, 0, 0) == 0 && sem_init(&idle_done, 0, 0) == 0);
    pthread_t idle, dropping;
    REQUIRE(pthread_create(&idle, NULL, use_then_idle, NULL) == 0);
    sem_wait(&arrived);
    REQUIRE(pthread_create(&dropping, NULL, use_both_then_drop, NULL) == 0);
    sem_wait(&arrived);
    REQUIRE(idle_cache != NULL && idle_cache->pool == pool);
    hook_point = KVA_TC_POINT_MARKED;
    kva_tc_test_hook(after_mark, NULL);
    kva_pool_destroy(pool);
    kva_tc_test_hook(NULL, NULL);
    CHECK(__atomic_load_n(&idle_cache->pool, __ATOMIC_ACQUIRE) == KVA_TC_NO_POOL); /* marked too */
    sem_post(&resume);
    pthread_join(dropping, NULL);
    sem_post(&idle_done);
    pthread_join(idle, NULL);
    thread_failures_merge();
    CHECK_STATUS(kva_check(other), KVA_OK);
    kva_pool_destroy(other);
    sem_destroy(&arrived);
    sem_destroy(&resume);
    sem_destroy(&idle_done);
}

/* ---- statistics while objects move between threads ----------------------------------------- */

/* Another thread allocates objects and hands them to this one, which frees them: remote frees,
 * counted in this thread's cache. Totalled cache by cache, a free could be counted while its
 * allocation, in a cache read before, was not: here, between the reading of the producer's cache
 * and this thread's, the producer allocates 10 more and this thread frees all 20: counted that
 * way, live counts would wrap below zero (and bytes in use pass the capacity). Free counts are
 * read first, then allocation counts. */
enum {
    HANDED = 20
};
static void *handed[HANDED];

static void *produce_in_two_batches(void *arg) {
    (void)arg;
    for (int i = 0; i < HANDED / 2; i++) TCHECK_STATUS(kva_alloc(pool, 64, &handed[i]), KVA_OK);
    sem_post(&arrived);
    sem_wait(&resume); /* inside the totalling */
    for (int i = HANDED / 2; i < HANDED; i++) TCHECK_STATUS(kva_alloc(pool, 64, &handed[i]), KVA_OK);
    sem_post(&arrived);
    sem_wait(&idle_done); /* alive, its cache listed, until the test is done */
    return NULL;
}

static void between_caches(int point, void *ctx) {
    (void)ctx;
    if (point != KVA_TC_POINT_COUNTED || hook_point != KVA_TC_POINT_COUNTED) return;
    hook_point = -1; /* after the first cache read, the producer's (the newest comes first) */
    sem_post(&resume);
    sem_wait(&arrived);
    for (int i = 0; i < HANDED; i++) CHECK_STATUS(kva_free(pool, handed[i]), KVA_OK);
}

static void test_stats_while_objects_move(void) {
    pool = make_pool(16 * MiB);
    REQUIRE(sem_init(&arrived, 0, 0) == 0 && sem_init(&resume, 0, 0) == 0 && sem_init(&idle_done, 0, 0) == 0);
    void *p;
    CHECK_STATUS(kva_alloc(pool, 64, &p), KVA_OK); /* this thread's cache, made first */
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    pthread_t producer;
    REQUIRE(pthread_create(&producer, NULL, produce_in_two_batches, NULL) == 0);
    sem_wait(&arrived);
    hook_point = KVA_TC_POINT_COUNTED;
    kva_tc_test_hook(between_caches, NULL);
    kva_stats st = stats();
    kva_tc_test_hook(NULL, NULL);
    CHECK(hook_point == -1);
    CHECK(st.live_allocations == 0 && st.bytes_in_use <= st.capacity && st.slab_free_bytes <= st.slab_bytes);
    kva_class_stats cs;
    REQUIRE(kva_get_class_stats(pool, (unsigned)kva_size_class_of(64), &cs) == KVA_OK);
    CHECK(cs.live_objects == 0);
    sem_post(&idle_done);
    pthread_join(producer, NULL);
    thread_failures_merge();
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
    sem_destroy(&arrived);
    sem_destroy(&resume);
    sem_destroy(&idle_done);
}

/* A thread whose cache of one pool is refused (no id left) still gives back its cache of
 * another pool when it exits. */

static void *two_pools(void *arg) {
    (void)arg;
    void *p;
    TCHECK_STATUS(kva_alloc(other, 64, &p), KVA_OK);
    TCHECK_STATUS(kva_free(other, p), KVA_OK);             /* a cache of `other`, holding a word */
    TCHECK_STATUS(kva_alloc(pool, 64, &p), KVA_ERR_NOMEM); /* no cache of `pool` to be had */
    return NULL;
}

static void test_refused_cache_keeps_the_others(void) {
    pool = make_pool(16 * MiB);
    other = make_pool(16 * MiB);
    pool->caches.next_id = UINT32_MAX;
    run_one(two_pools, NULL);
    kva_stats st;
    REQUIRE(kva_get_stats(other, &st) == KVA_OK);
    CHECK(st.thread_caches == 0 && st.cached_bytes == 0 && st.live_allocations == 0);
    CHECK(other->caches.free_ids_count == 1); /* its id came back for reuse */
    CHECK_STATUS(kva_check(other), KVA_OK);
    kva_pool_destroy(other);
    kva_pool_destroy(pool);
}

int main(void) {
    test_ids_are_reused();
    test_ids_exhausted();
    test_refused_free_makes_no_cache();
    test_free_only_thread_keeps_one_word();
    test_allocating_thread_keeps_its_limit();
    test_remote_frees_make_no_keeper();
    test_raced_double_free_is_not_handed_out_twice();
    test_remote_free_outlived_by_its_slab();
    test_a_remote_free_outlived_by_its_object_stands();
    test_racing_free_lands_in_a_released_slab();
    test_late_free_drained_in_another_class();
    test_claim_racing_a_remote_free_counts_once();
    test_destroy_outlived_by_a_cache();
    test_stats_while_objects_move();
    test_free_window();
    test_refused_cache_keeps_the_others();
    return CHECK_DONE();
}
