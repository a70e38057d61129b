/*
 * tcache.h — thread caches: the words of slab objects a thread owns, one cache per (thread,
 * pool), and the fast paths that use them.
 *
 * A cache owns up to a class's word limit of l0 words per size class (slab.h explains
 * ownership). One of them is the current word, which allocation pops from; a free into any
 * owned word sets the object's bit. Both are a handful of instructions on memory no other thread
 * writes. Words move in batches of up to 64 objects: a dry current word makes the next owned
 * word with free objects current; when none has any, a fresh word is claimed from the arena of
 * the thread's CPU (arena.h) under that arena's lock, and the oldest dry word goes back only when
 * the cache is at its limit (all of them when the thread has freed none of the class since they
 * last ran dry: see refill); a free into a word nobody owns claims that word into the cache (the
 * oldest owned word goes back to its arena when the cache is full); a free into a word another
 * cache owns is a remote free (slab.h).
 *
 * The limit is KVA_TC_BYTES of object span, between KVA_TC_MIN_WORDS and KVA_TC_WORDS words:
 * 32 words (2,048 objects, 128 KiB) of 64 B objects, 4 words from 512 B up (so above 512 B the
 * minimum decides: 4 words of at most 64 objects, as many as a slab holds, e.g. 256 KiB of
 * 1 KiB objects or 8 MiB of 64 KiB ones). A thread that frees the class keeps its dry words,
 * because they cost nothing (no free memory in them) and the objects now live in them are the
 * ones it frees next: a batch of up to the limit's objects then cycles through owned words with
 * no lock at all, as a batch within one mimalloc page (64 KiB of small objects) does.
 * The free memory a cache can hold is bounded by that limit per class it allocates from.
 *
 * The owned words are a cache kept out of band, like the offset arrays of tcmalloc's per-CPU
 * caches, but a bitmap word rather than an array: the object's bit is its state, so a double
 * free into a cache is caught exactly on the fast path, with no scan and no atomic operation.
 *
 * Lifetime: a cache is made by the thread's first call on the pool and lives in the thread's
 * list and its pool's registry (under the registry lock). The thread's exit gives its words back
 * and folds its counters into the registry (a pthread key destructor); a pool's destruction marks
 * its caches dead (pool KVA_TC_NO_POOL) and each thread frees its dead caches on its next lookup
 * or at exit.
 *
 * Files: tcache.c the words (allocation, refills, the complete free, flushing, windows);
 * tcache_registry.c the registry and the caches' lifetime (lookup, creation, thread exit, the
 * totals).
 */
#ifndef KVA_TCACHE_H
#define KVA_TCACHE_H

#include "slab.h"

#define KVA_TC_WORDS 32           /* the most words a class keeps */
#define KVA_TC_MIN_WORDS 4        /* the fewest, whatever the object size */
#define KVA_TC_BYTES (128u << 10) /* object span kept per class: 64 objects x size per word */

/* What allocation of a class reads: 64 bytes, so that finding it is one shift. */
typedef struct kva_tc_hot {
    uint64_t *l0;        /* the current word, or the always-zero word when there is none */
    uint64_t *remote;    /* the current word's remote word (the always-zero word likewise) */
    unsigned char *addr; /* the address of the current word's first object */
    uint64_t size;       /* the class's object size */
    uint64_t allocs;     /* by this thread since the cache was made */
    uint64_t reserved[3];
} kva_tc_hot;

_Static_assert(sizeof(kva_tc_hot) == 64, "a class's allocation record is 64 bytes");

/* The owned words of a class: slab[i], word[i] for i < nowned; cur indexes the current one
 * (KVA_NIL: none). Changed by the owner only, read by the stats from other threads. */
typedef struct kva_tc_class {
    uint32_t nowned;
    uint32_t cur;
    uint32_t limit;                  /* the words kept while allocating (see above) */
    uint64_t frees_at_refill;        /* the class's free count when its owned words last ran dry */
    uint32_t slab[KVA_TC_WORDS + 1]; /* + 1: a claim adds its word before the oldest goes back */
    uint32_t word[KVA_TC_WORDS + 1];
} kva_tc_class;

/* The free windows. A window is a run of consecutive words of one slab, all owned by this
 * cache, around a word a fast free landed in. A free inside it needs neither the slab's
 * descriptor nor an owner entry (the cache owns them all: only this thread could give one back,
 * and doing so closes every window), so it is an offset, one multiply and the word. A thread's
 * words of a class are mostly claimed in a row from one slab, and frees come in runs within
 * them (a batch frees what it allocated), which is what makes a window pay.
 *
 * A cache has KVA_TC_WINDOWS of them, one per 2 MiB of address space modulo their number
 * (kva_tc_window_of): slabs of different classes are different chunks, so frees that alternate
 * between classes mostly find each class's window in its own place; two slabs that share a place
 * leave it to whichever reached it first, since a window moves only on the second miss in a row
 * from one slab (missed), so that they do not move it back and forth, each move a scan of
 * owner entries. The place is a hint only: the free checks the window's range before anything
 * else. span 0: closed. */
#define KVA_TC_WINDOWS 16
#define KVA_TC_WINDOW_SHIFT 21

typedef struct kva_tc_window {
    uintptr_t base;        /* the address of the run's first object */
    uint64_t span;         /* its objects times their size: an offset below it is inside */
    uint64_t magic;        /* kva_div_magic(size) */
    uint64_t *l0, *remote; /* the run's first word and that word's remote word */
    uint64_t *frees;       /* the class's free counter */
    const void *missed;    /* the slab of the last free that missed this window */
    uint64_t reserved;
} kva_tc_window;

_Static_assert(sizeof(kva_tc_window) == 64, "a window is one cache line");

struct kva_tc_registry;

typedef struct kva_tcache {
    kva_pool *pool; /* (atomic) KVA_TC_NO_POOL once the pool is destroyed */
    uint32_t id;    /* the owner id its words carry, unique in the pool */
    uint32_t reserved;
    kva_tc_window windows[KVA_TC_WINDOWS];
    kva_tc_hot hot[KVA_NUM_SIZE_CLASSES];
    /* Frees this thread made into words it owns or claimed, since the cache was made. A remote
     * free (into another cache's word) is not among them: it is counted when its bit reaches
     * the object's word, by the thread that merges it there, in that thread's `merged`. */
    uint64_t frees[KVA_NUM_SIZE_CLASSES];
    uint64_t merged[KVA_NUM_SIZE_CLASSES]; /* objects other threads' remote frees freed, merged here */
    kva_tc_class cls[KVA_NUM_SIZE_CLASSES];
    uint64_t remote_frees;          /* remote frees this thread made (passed on; counted as frees where merged) */
    struct kva_tcache *thread_next; /* the thread's caches */
    struct kva_tcache *pool_prev, *pool_next; /* the pool's caches (registry lock) */
    struct kva_tc_registry *registry;         /* its pool's, while the pool lives */
} kva_tcache;

/* A pool's thread caches (the pool holds one, pool.h): the live caches, what those whose threads
 * have exited counted, and the ids free for reuse. Under the registry lock, one for every pool
 * (kva_tc_registry_lock), but for what says atomic. */
typedef struct kva_tc_registry {
    kva_pool *pool;      /* the pool: what its caches' pool field says while they live */
    kva_slabs *slabs;    /* the pool's slabs */
    unsigned char *base; /* the pool's base address: offsets from it are the slabs' */
    kva_tcache *caches;  /* the live ones, linked by pool_prev and pool_next */
    uint32_t ncaches;
    uint32_t next_id; /* the last id handed out fresh */
    /* (atomic) A cache made and faulted in at creation for the first thread that needs one, or
     * NULL once taken (kva_tc_make_spare). */
    kva_tcache *spare;
    uint32_t *free_ids; /* ids of exited threads' caches, for reuse (grown by doubling) */
    uint32_t free_ids_count, free_ids_capacity;
    uint64_t retired_allocs[KVA_NUM_SIZE_CLASSES];
    uint64_t retired_frees[KVA_NUM_SIZE_CLASSES];
    uint64_t retired_remote_frees;
    /* (atomic) Frees by threads with no cache (a remote one counted here only if drained here). */
    uint64_t uncached_frees[KVA_NUM_SIZE_CLASSES];
} kva_tc_registry;

/* The pool of a cache that has none (the dummy) or whose pool is gone: an address no pool has
 * and that is not NULL, so the fast paths' one compare of tc->pool with the caller's pool also
 * turns a NULL pool away. */
extern const char kva_tc_nowhere;
#define KVA_TC_NO_POOL ((kva_pool *)(uintptr_t)&kva_tc_nowhere)

/* The calling thread's most recently used cache: a dummy whose pool is KVA_TC_NO_POOL until it
 * has one. */
extern __thread kva_tcache *kva_tc_current __attribute__((tls_model("initial-exec")));

/* The always-zero word a class with no current word allocates from (its l0 and remote). */
uint64_t *kva_tc_no_word(void);

/* Sets up the registry of a new pool (zeroed before): its pool, slabs and base, and a spare
 * cache record, its pages faulted in, for the first thread to call kva_tc_get: made out of the
 * process heap, a cache's first touch of fresh heap pages would otherwise be page faults in that
 * thread's first call. Without host memory for the spare, that thread makes its own. */
void kva_tc_registry_init(kva_tc_registry *reg, kva_pool *pool, kva_slabs *slabs, unsigned char *base);

/* The pool is going away: its caches are marked dead (their threads free them) and what the
 * registry holds is freed. */
void kva_tc_registry_fini(kva_tc_registry *reg);

/* This thread's cache for the registry's pool, made on first use; NULL if there is no host
 * memory for one. */
kva_tcache *kva_tc_get(kva_tc_registry *reg);
/* This thread's cache for pool without making one: NULL if this thread has none. */
kva_tcache *kva_tc_find(const kva_pool *pool);
/* In a forked child (one thread, every lock held by the fork handlers): this thread lets go of
 * its cache of pool, if it has one, without giving its words back, as the parent's other
 * threads' caches are let go of: it stays in the registry, and no thread reaches it again, so
 * no fast path of this process serves the pool from it. */
void kva_tc_forsake(const kva_pool *pool);

/* Makes the next owned word of class c after the current one (round the ring) that has a free
 * object, remote frees merged in, the current word: 1; 0 when every owned word is dry. No lock:
 * the first step of a refill, which the allocation fast path takes on its own. */
int kva_tc_next_word(kva_tc_registry *reg, kva_tcache *tc, unsigned c);

/* An object of class c at *offset: from the current word, else after a refill. 0 when no slab
 * anywhere in the pool has a free object of the class and no new slab can be made. */
int kva_tc_alloc(kva_tc_registry *reg, kva_tcache *tc, unsigned c, uint64_t *offset);

/* The complete free of the object at pool offset `offset` in a slab chunk: KVA_OK,
 * KVA_ERR_BAD_POINTER (not an object's start) or KVA_ERR_DOUBLE_FREE, which change nothing. */
kva_status kva_tc_free(kva_tc_registry *reg, kva_tcache *tc, uint64_t offset);

/* The free of a thread that has no cache of the pool and cannot get one (no host memory):
 * validated as kva_tc_free, then freed into the word under its arena lock, or passed to the
 * word's owner. KVA_OK, KVA_ERR_BAD_POINTER or KVA_ERR_DOUBLE_FREE. */
kva_status kva_tc_free_uncached(kva_tc_registry *reg, uint64_t offset);

/* Gives every word of the cache back to its arena. */
void kva_tc_flush(kva_tc_registry *reg, kva_tcache *tc);

/* A new cache's classes: each class's object size and word limit, and no current word. */
void kva_tc_init_classes(kva_tcache *tc, const kva_slabs *sl);

/* Test hook (process-wide; NULL restores): fn(point, ctx) runs at each point below, a window in
 * which another thread's step may strike, so that a test can place that step there.
 *  KVA_TC_POINT_PASSING in a remote free, just before its atomic OR, its checks made;
 *  KVA_TC_POINT_PASSED  in a remote free, just after its atomic OR has passed the object on;
 *  KVA_TC_POINT_CLAIMING in a free into a word nobody owns, the arena lock held and the object
 *                       found live, just before the word is claimed;
 *  KVA_TC_POINT_MARKED  in a pool's destruction, just after one of its caches is marked dead
 *                       (the registry lock held);
 *  KVA_TC_POINT_COUNTED in kva_tc_totals_locked, just after a cache's free counts are read (the
 *                       pool's locks held). */
enum {
    KVA_TC_POINT_PASSED,
    KVA_TC_POINT_MARKED,
    KVA_TC_POINT_COUNTED,
    KVA_TC_POINT_PASSING,
    KVA_TC_POINT_CLAIMING
};
void kva_tc_test_hook(void (*fn)(int point, void *ctx), void *ctx);

/* The hook's function and context (set by kva_tc_test_hook), and the check at each point. */
extern void (*kva_tc_test_fn)(int point, void *ctx);
extern void *kva_tc_test_ctx;
KVA_INLINE void kva_tc_test_point(int point) {
    void (*fn)(int, void *) = __atomic_load_n(&kva_tc_test_fn, __ATOMIC_ACQUIRE);
    if (kva_unlikely(fn != NULL)) fn(point, __atomic_load_n(&kva_tc_test_ctx, __ATOMIC_ACQUIRE));
}

void kva_tc_registry_lock(void);
void kva_tc_registry_unlock(void);

/* What the registry's caches hold and have counted: with the registry lock held. Exact when the
 * caches' threads are not running; a close estimate while they are. */
typedef struct kva_tc_totals {
    uint64_t allocs[KVA_NUM_SIZE_CLASSES];
    /* counted: objects whose bit reached their word (S5); not the frees made: see kva_tc_frees_made */
    uint64_t frees[KVA_NUM_SIZE_CLASSES];
    uint64_t pending[KVA_NUM_SIZE_CLASSES]; /* remote frees waiting in owned words to be merged */
    uint64_t cached[KVA_NUM_SIZE_CLASSES];  /* free objects in owned words (remote ones too) */
    uint64_t remote_frees;
    uint32_t caches;
    uint32_t foreign_caches; /* caches of threads other than the caller */
} kva_tc_totals;
void kva_tc_totals_locked(const kva_tc_registry *reg, kva_tc_totals *out);

/* S6 for one cache (tcache_check.c): its words of each class are words of slabs of that class
 * that it owns, within its limit; its current words and free windows are on them, as they are.
 * Adds the words it lists to *listed (when not NULL). KVA_OK, or KVA_ERR_CORRUPT naming what is
 * broken. Run by the cache's own thread, or under the registry lock while no other thread holds
 * a cache. */
kva_status kva_tc_check_cache(const kva_tc_registry *reg, const kva_tcache *tc, uint64_t *listed);

/* kva_tc_check_cache over every cache of the registry, whose list must hold its count of
 * caches (registry lock held, no other thread holding a cache). */
kva_status kva_tc_check_caches(const kva_tc_registry *reg, uint64_t *listed);

/* Frees of class c made so far by the totals, counted and pending: what statistics report (a
 * remote free counts from the moment it is made). */
KVA_INLINE uint64_t kva_tc_frees_made(const kva_tc_totals *t, unsigned c) { return t->frees[c] + t->pending[c]; }

/* Live objects of class c by the totals: allocations less frees, counted and pending. The
 * totals never count a free before its allocation; the clamp covers what an estimate read
 * while other threads run can still get wrong (a stray remote bit of a racing double free
 * read as pending, say). */
KVA_INLINE uint64_t kva_tc_live(const kva_tc_totals *t, unsigned c) {
    uint64_t gone = kva_tc_frees_made(t, c);
    return t->allocs[c] > gone ? t->allocs[c] - gone : 0;
}

/* The window free: 1 if ptr is a live object of its window's words, now freed; 0, with nothing
 * changed, otherwise (outside the window, not an object's start, free already, remote frees
 * waiting in its word). */
KVA_INLINE kva_tc_window *kva_tc_window_of(kva_tcache *tc, uintptr_t address) {
    return &tc->windows[(address >> KVA_TC_WINDOW_SHIFT) & (KVA_TC_WINDOWS - 1)];
}

KVA_INLINE int kva_tc_free_window(kva_tcache *tc, const void *ptr) {
    const kva_tc_window *win = kva_tc_window_of(tc, (uintptr_t)ptr);
    uint64_t d = (uint64_t)((uintptr_t)ptr - win->base);
    if (kva_unlikely(d >= win->span)) return 0;
    uint64_t object;
    if (kva_unlikely(!kva_div_exact(d, win->magic, &object))) return 0;
    uint64_t w = object >> 6, *l0 = win->l0 + w, bit = (uint64_t)1 << (object & 63), bits = kva_load(l0);
    if (kva_unlikely(((bits & bit) | kva_load(win->remote + w)) != 0)) return 0;
    kva_store(l0, bits | bit);
    kva_bump_release(win->frees);
    return 1;
}

/* Opens window win on the run of words this cache owns around word w of slab `slab`, whose
 * first object is at word_base (kva_tc_free_fast, after a free into word w). At most
 * KVA_TC_WORDS words either side are looked at: no cache owns more of a class. */
void kva_tc_open_window(kva_tcache *tc, kva_tc_window *win, const kva_slab *slab, uint32_t w, uintptr_t word_base,
                        unsigned c);

/* Closes every window (a word leaves the cache). */
void kva_tc_close_windows(kva_tcache *tc);

/* The free fast path: 1 if it freed a live object of a word this cache owns (with no remote
 * frees waiting in it), moving the object's window to that word's run on a second such free in
 * the slab; 0, with nothing changed, in every
 * other case, for kva_tc_free. */
KVA_INLINE int kva_tc_free_fast(const kva_slabs *sl, kva_tcache *tc, uintptr_t base, uint64_t offset) {
    const kva_slab *slab = &sl->slabs[offset >> sl->chunk_shift];
    unsigned c = kva_load(&slab->cls);
    if (kva_unlikely(c == KVA_SLAB_NONE)) return 0;
    uint64_t rel = offset & sl->chunk_mask, object;
    if (kva_unlikely(!kva_div_exact(rel, slab->magic, &object) || object >= slab->nobj)) return 0;
    uint64_t w = object >> 6;
    kva_assert_internal(c < KVA_NUM_SIZE_CLASSES && w < slab->l0_words);
    if (kva_unlikely(kva_load(kva_slab_owner_fast(slab) + w) != tc->id)) return 0;
    uint64_t *l0 = slab->l0 + w, bit = (uint64_t)1 << (object & 63), bits = kva_load(l0);
    if (kva_unlikely(((bits & bit) | kva_load(kva_slab_remote_fast(slab) + w)) != 0)) return 0;
    kva_store(l0, bits | bit);
    kva_bump_release(&tc->frees[c]);
    kva_tc_window *win = kva_tc_window_of(tc, base + offset);
    if (kva_unlikely(win->missed == slab))
        kva_tc_open_window(tc, win, slab, (uint32_t)w, base + offset - (object & 63) * slab->size, c);
    else win->missed = slab;
    return 1;
}

/* The allocation fast path: pops the lowest free object of the current word of class c. A free
 * object whose remote bit is set too is two frees that raced and were both accepted (slab.h):
 * while the word holds one, its objects are left to the next merge of the word
 * (kva_tc_next_word), which takes the second free out of the count, so that no object is handed
 * out while a stray remote bit could free it again. */
KVA_INLINE int kva_tc_alloc_fast(kva_tcache *tc, unsigned c, void **out) {
    kva_tc_hot *k = &tc->hot[c];
    kva_opaque(k);
    uint64_t bits = kva_load(k->l0);
    if (kva_unlikely(bits == 0 || (kva_load(k->remote) & bits) != 0)) return 0;
    kva_store(k->l0, bits & (bits - 1));
    kva_bump(&k->allocs);
    *out = k->addr + (uint64_t)__builtin_ctzll(bits) * k->size;
    return 1;
}

#endif
