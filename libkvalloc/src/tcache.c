/*
 * tcache.c — thread caches' words: allocation and refills from the arenas, the complete free
 * (own words, words nobody owns, remote frees), flushing, the free windows. See tcache.h and
 * slab.h; the caches' lifetime is tcache_registry.c's.
 */
#include "tcache.h"

/* Every cache's current word before it has one, and after it is dropped: never written. */
static uint64_t no_word;

/* ---- the owned words of a class ------------------------------------------------------------ */

static uint64_t *word_l0(const kva_slabs *sl, uint32_t s, uint32_t w) { return sl->slabs[s].l0 + w; }

static uint64_t *word_remote(const kva_slabs *sl, uint32_t s, uint32_t w) {
    return kva_slab_remote_fast(&sl->slabs[s]) + w;
}

static void set_current(kva_tc_registry *reg, kva_tcache *tc, unsigned c, uint32_t i) {
    const kva_slabs *sl = reg->slabs;
    kva_tc_class *k = &tc->cls[c];
    kva_tc_hot *h = &tc->hot[c];
    uint32_t s = k->slab[i], w = k->word[i];
    kva_assert_internal(i < k->nowned && kva_load(&kva_slab_owner_fast(&sl->slabs[s])[w]) == tc->id);
    kva_store(&k->cur, i);
    h->addr = reg->base + ((uint64_t)s << sl->chunk_shift) + (uint64_t)w * 64 * h->size;
    h->l0 = word_l0(sl, s, w);
    h->remote = word_remote(sl, s, w);
}

uint64_t *kva_tc_no_word(void) { return &no_word; }

static void no_current(kva_tcache *tc, unsigned c) {
    kva_store(&tc->cls[c].cur, KVA_NIL);
    tc->hot[c].l0 = &no_word;
    tc->hot[c].remote = &no_word;
}

static void add_owned(kva_tc_class *k, uint32_t s, uint32_t w) {
    uint32_t n = k->nowned;
    kva_assert_internal(n < KVA_TC_WORDS + 1);
    kva_store(&k->slab[n], s);
    kva_store(&k->word[n], w);
    kva_store(&k->nowned, n + 1);
}

/* Drops owned word i of class c from the set, keeping the order (oldest first) of the others.
 * The free window closes: it may be on that word. */
static void remove_owned(kva_tcache *tc, unsigned c, uint32_t i) {
    kva_tc_class *k = &tc->cls[c];
    uint32_t n = k->nowned;
    kva_assert_internal(i < n);
    kva_tc_close_windows(tc);
    if (k->cur == i) no_current(tc, c);
    for (uint32_t j = i; j + 1 < n; j++) {
        kva_store(&k->slab[j], k->slab[j + 1]);
        kva_store(&k->word[j], k->word[j + 1]);
    }
    if (k->cur != KVA_NIL && k->cur > i) kva_store(&k->cur, k->cur - 1);
    kva_store(&k->nowned, n - 1);
}

/* Gives owned word w of slab s (class c) back to its arena. */
static void give_back(kva_slabs *sl, kva_tcache *tc, unsigned c, uint32_t s, uint32_t w) {
    kva_assert_internal(kva_load(&kva_slab_owner_fast(&sl->slabs[s])[w]) == tc->id);
    kva_arena *arena = &sl->arenas[sl->slabs[s].arena];
    pthread_mutex_lock(&arena->lock);
    unsigned merged = kva_slab_release_word(sl, s, w);
    pthread_mutex_unlock(&arena->lock);
    kva_add_release(&tc->merged[c], merged);
}

/* Gives back an owned word with no free object without the arena lock: nothing about the slab
 * changes (all its objects count as in use either way) except the owner. A remote free that
 * passed an object on just before is drained under the lock (the owner store and the remote
 * check are ordered against the remote side's OR and owner check, see slab.h). */
static void give_back_dry(kva_slabs *sl, kva_tcache *tc, unsigned c, uint32_t s, uint32_t w) {
    const kva_slab *slab = &sl->slabs[s];
    const kva_class_geometry *g = &sl->geom[slab->cls];
    /* Read while the word is still ours and the slab cannot go: see kva_slab_drain_remote. */
    uint64_t *remote = &kva_slab_remote(slab, g)[w];
    unsigned a = slab->arena;
    kva_assert_internal(kva_load(&kva_slab_owner(slab, g)[w]) == tc->id && kva_load(&slab->l0[w]) == 0);
    __atomic_store_n(&kva_slab_owner(slab, g)[w], KVA_NO_OWNER, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(remote, __ATOMIC_SEQ_CST) == 0) return;
    pthread_mutex_lock(&sl->arenas[a].lock);
    unsigned dc = c, merged = kva_slab_drain_remote(sl, a, s, w, &dc);
    pthread_mutex_unlock(&sl->arenas[a].lock);
    kva_add_release(&tc->merged[dc], merged);
}

/* ---- the free window ----------------------------------------------------------------------- */

void kva_tc_open_window(kva_tcache *tc, kva_tc_window *win, const kva_slab *slab, uint32_t w, uintptr_t word_base,
                        unsigned c) {
    const uint32_t *owner = kva_slab_owner_fast(slab);
    uint32_t first = w, last = w, id = tc->id;
    while (first > 0 && w - first < KVA_TC_WORDS && kva_load(&owner[first - 1]) == id) first--;
    while (last + 1 < slab->l0_words && last - w < KVA_TC_WORDS && kva_load(&owner[last + 1]) == id) last++;
    uint64_t end = (uint64_t)(last + 1) * 64, objects = (end < slab->nobj ? end : slab->nobj) - (uint64_t)first * 64;
    win->base = word_base - (uint64_t)(w - first) * 64 * slab->size;
    win->span = objects * slab->size;
    win->magic = slab->magic;
    win->l0 = slab->l0 + first;
    win->remote = kva_slab_remote_fast(slab) + first;
    win->frees = &tc->frees[c];
}

void kva_tc_close_windows(kva_tcache *tc) {
    for (unsigned i = 0; i < KVA_TC_WINDOWS; i++) tc->windows[i].span = 0;
}

/* ---- allocation ---------------------------------------------------------------------------- */

static int claim_from(kva_tc_registry *reg, kva_tcache *tc, unsigned c, unsigned a, int may_grow) {
    kva_slabs *sl = reg->slabs;
    uint32_t s, w;
    pthread_mutex_lock(&sl->arenas[a].lock);
    int ok = kva_slab_claim(sl, a, c, tc->id, may_grow, &s, &w, &tc->merged[c]);
    pthread_mutex_unlock(&sl->arenas[a].lock);
    if (!ok) return 0;
    kva_tc_class *k = &tc->cls[c];
    add_owned(k, s, w);
    set_current(reg, tc, c, k->nowned - 1);
    return 1;
}

int kva_tc_next_word(kva_tc_registry *reg, kva_tcache *tc, unsigned c) {
    kva_slabs *sl = reg->slabs;
    kva_tc_class *k = &tc->cls[c];
    uint32_t n = k->nowned, i = k->cur == KVA_NIL ? 0 : k->cur + 1;
    for (uint32_t j = 0; j < n; j++, i++) {
        if (i == n) i = 0;
        uint32_t s = k->slab[i], w = k->word[i];
        if (kva_slab_merge_remote(word_l0(sl, s, w), word_remote(sl, s, w), &tc->merged[c])) {
            set_current(reg, tc, c, i);
            return 1;
        }
    }
    return 0;
}

/* Makes the current word of class c one with a free object. Order: the owned words after the
 * current one, round the ring (remote frees merged in: kva_tc_next_word); then a fresh word from
 * the arena of this CPU, growing a slab there, with dry words given back first (below); then
 * from any other arena's slabs; then, with every arena's spare slabs and this thread's other
 * cached words back in the buddy, a new slab once more. */
static int refill(kva_tc_registry *reg, kva_tcache *tc, unsigned c) {
    kva_slabs *sl = reg->slabs;
    kva_tc_class *k = &tc->cls[c];
    if (kva_tc_next_word(reg, tc, c)) return 1;
    /* Every owned word is dry. A thread that has freed objects of the class since the last
     * time keeps them (up to its limit, the oldest going first), since the objects now live in
     * them are the ones it frees next. One that has not (a producer whose objects other threads
     * free) gives them all back: freed into a word nobody owns, an object lets the freeing
     * thread claim the word and free the rest of it with plain stores, where a word the
     * producer kept would take an atomic remote free per object. */
    uint64_t frees = kva_load(&tc->frees[c]);
    uint32_t keep = frees != k->frees_at_refill ? k->limit - 1 : 0;
    k->frees_at_refill = frees;
    while (k->nowned > keep) {
        give_back_dry(sl, tc, c, k->slab[0], k->word[0]);
        remove_owned(tc, c, 0);
    }
    unsigned a = kva_cpu_current() % sl->narenas;
    kva_cpu_after_read();
    if (claim_from(reg, tc, c, a, 1)) return 1;
    for (unsigned i = 1; i < sl->narenas; i++)
        if (claim_from(reg, tc, c, (a + i) % sl->narenas, 0)) return 1;
    kva_tc_flush(reg, tc);
    kva_slab_trim(sl);
    return claim_from(reg, tc, c, a, 1);
}

int kva_tc_alloc(kva_tc_registry *reg, kva_tcache *tc, unsigned c, uint64_t *offset) {
    void *out;
    while (!kva_tc_alloc_fast(tc, c, &out)) {
        int refilled = refill(reg, tc, c);
        kva_assert_expensive(kva_tc_check_cache(reg, tc, NULL) == KVA_OK);
        if (!refilled) return 0;
    }
    *offset = (uint64_t)((unsigned char *)out - reg->base);
    return 1;
}

/* ---- free ---------------------------------------------------------------------------------- */

/* A free into a word another cache owns: the object's remote bit, for the owner to merge. */
static kva_status remote_free(kva_slabs *sl, kva_tcache *tc, const kva_object_ref *ref) {
    /* Everything read before the OR: once the object is passed on, its slab may be emptied and
     * made anew (see kva_slab_drain_remote). */
    uint64_t *remote = kva_ref_remote(sl, ref);
    uint32_t *owner = kva_ref_owner(sl, ref);
    unsigned a = kva_load(&sl->slabs[ref->slab].arena);
    kva_assert_internal(ref->cls < KVA_NUM_SIZE_CLASSES && a < sl->narenas);
    if (kva_load(ref->l0) & ref->bit) return KVA_ERR_DOUBLE_FREE;
    kva_tc_test_point(KVA_TC_POINT_PASSING);
    if (__atomic_fetch_or(remote, ref->bit, __ATOMIC_SEQ_CST) & ref->bit) return KVA_ERR_DOUBLE_FREE;
    kva_tc_test_point(KVA_TC_POINT_PASSED);
    /* Passed on: accepted. An owner's free racing this one is accepted too and counted once: a
     * remote free counts where its bit is merged, and a bit that finds its object free is not
     * (slab.h). Nothing after the OR re-checks: the owner may merge the bit, hand the object out
     * again and another thread free that next life, and the remote word keeps no generation to
     * tell those bits apart; taking 'our' bit back would refuse a valid free and lose another
     * (test_tcache places the steps). */
    kva_bump(&tc->remote_frees);
    /* Given back meanwhile: nobody will merge the bit, so free it in the slab now. */
    if (__atomic_load_n(owner, __ATOMIC_SEQ_CST) == KVA_NO_OWNER) {
        pthread_mutex_lock(&sl->arenas[a].lock);
        unsigned dc = ref->cls, merged = kva_slab_drain_remote(sl, a, ref->slab, ref->word, &dc);
        pthread_mutex_unlock(&sl->arenas[a].lock);
        kva_add_release(&tc->merged[dc], merged);
    }
    return KVA_OK;
}

/* Words a cache keeps for a class: its limit while it allocates objects of the class (it has a
 * current word), one while it only frees them, so that a thread that only frees (a consumer
 * of objects others allocate) holds at most one word of free objects per class. */
static uint32_t words_kept(const kva_tc_class *k) { return k->cur != KVA_NIL ? k->limit : 1; }

/* The oldest owned word that is not the current one, or KVA_NIL. */
static uint32_t oldest_spare(const kva_tc_class *k, uint32_t skip) {
    for (uint32_t i = 0; i < k->nowned; i++)
        if (i != k->cur && i != skip) return i;
    return KVA_NIL;
}

/* A free into a word nobody owns: the word is claimed into the cache and the object freed into
 * it. Every check is made again under the arena lock before anything changes, so a refused
 * call (the word claimed by another thread meanwhile, a racing double free) changes nothing;
 * then the words beyond the cache's bound go back, the oldest first: under the same lock when
 * they belong to the same arena, after it otherwise. Returns KVA_ERR_BAD_POINTER (never) or
 * KVA_ERR_DOUBLE_FREE, or -1 when the word has an owner after all (the caller starts over). */
static int claim_and_free(kva_slabs *sl, kva_tcache *tc, const kva_object_ref *ref) {
    kva_tc_class *k = &tc->cls[ref->cls];
    unsigned a = kva_load(&sl->slabs[ref->slab].arena);
    kva_arena *arena = &sl->arenas[a];
    pthread_mutex_lock(&arena->lock);
    if (kva_slab_owner_of(sl, ref) != KVA_NO_OWNER) {
        pthread_mutex_unlock(&arena->lock);
        return -1;
    }
    if (!kva_slab_is_live(sl, ref)) {
        pthread_mutex_unlock(&arena->lock);
        return KVA_ERR_DOUBLE_FREE;
    }
    kva_tc_test_point(KVA_TC_POINT_CLAIMING);
    unsigned merged = kva_slab_claim_word(sl, ref->slab, ref->word, tc->id, ref->bit);
    kva_assert_internal(kva_slab_owner_of(sl, ref) == tc->id);
    add_owned(k, ref->slab, ref->word);
    kva_bump_release(&tc->frees[ref->cls]);
    kva_add_release(&tc->merged[ref->cls], merged);
    uint32_t fresh = k->nowned - 1;
    for (uint32_t victim; k->nowned > words_kept(k) && (victim = oldest_spare(k, fresh)) != KVA_NIL;) {
        if (sl->slabs[k->slab[victim]].arena != a) break;
        kva_add_release(&tc->merged[ref->cls], kva_slab_release_word(sl, k->slab[victim], k->word[victim]));
        remove_owned(tc, ref->cls, victim);
        fresh--;
    }
    pthread_mutex_unlock(&arena->lock);
    for (uint32_t victim; k->nowned > words_kept(k) && (victim = oldest_spare(k, k->nowned - 1)) != KVA_NIL;) {
        give_back(sl, tc, ref->cls, k->slab[victim], k->word[victim]);
        remove_owned(tc, ref->cls, victim);
    }
    return KVA_OK;
}

kva_status kva_tc_free(kva_tc_registry *reg, kva_tcache *tc, uint64_t offset) {
    kva_slabs *sl = reg->slabs;
    kva_object_ref ref;
    if (!kva_slab_locate(sl, offset, &ref)) return KVA_ERR_BAD_POINTER;
    for (;;) {
        uint32_t owner = kva_slab_owner_of(sl, &ref);
        if (owner == tc->id) {
            /* Its remote frees first: the object may be among them. */
            uint64_t bits = kva_slab_merge_remote(ref.l0, word_remote(sl, ref.slab, ref.word), &tc->merged[ref.cls]);
            if (bits & ref.bit) return KVA_ERR_DOUBLE_FREE;
            kva_store(ref.l0, bits | ref.bit);
            kva_bump_release(&tc->frees[ref.cls]);
            return KVA_OK;
        }
        if (owner != KVA_NO_OWNER) return remote_free(sl, tc, &ref);
        if (!kva_slab_is_live(sl, &ref)) return KVA_ERR_DOUBLE_FREE;
        int st = claim_and_free(sl, tc, &ref);
        kva_assert_expensive(kva_tc_check_cache(reg, tc, NULL) == KVA_OK);
        if (st >= 0) return (kva_status)st;
    }
}

kva_status kva_tc_free_uncached(kva_tc_registry *reg, uint64_t offset) {
    kva_slabs *sl = reg->slabs;
    kva_object_ref ref;
    if (!kva_slab_locate(sl, offset, &ref)) return KVA_ERR_BAD_POINTER;
    for (;;) {
        if (!kva_slab_is_live(sl, &ref)) return KVA_ERR_DOUBLE_FREE;
        if (kva_slab_owner_of(sl, &ref) != KVA_NO_OWNER) {
            /* As a remote free, counted in the registry's own counters for want of a cache. */
            uint64_t *remote = kva_ref_remote(sl, &ref);
            uint32_t *owner = kva_ref_owner(sl, &ref);
            unsigned a = kva_load(&sl->slabs[ref.slab].arena);
            if (__atomic_fetch_or(remote, ref.bit, __ATOMIC_SEQ_CST) & ref.bit) return KVA_ERR_DOUBLE_FREE;
            /* Counted where the bit is merged: here, if the word was given back meanwhile. */
            if (__atomic_load_n(owner, __ATOMIC_SEQ_CST) == KVA_NO_OWNER) {
                pthread_mutex_lock(&sl->arenas[a].lock);
                unsigned dc = ref.cls, merged = kva_slab_drain_remote(sl, a, ref.slab, ref.word, &dc);
                pthread_mutex_unlock(&sl->arenas[a].lock);
                if (merged) __atomic_fetch_add(&reg->uncached_frees[dc], merged, __ATOMIC_RELEASE);
            }
            return KVA_OK;
        }
        kva_arena *arena = &sl->arenas[kva_load(&sl->slabs[ref.slab].arena)];
        pthread_mutex_lock(&arena->lock);
        int live = kva_slab_is_live(sl, &ref);
        int freed = live && kva_slab_free_in_unowned(sl, ref.slab, ref.word, ref.bit);
        pthread_mutex_unlock(&arena->lock);
        if (!live) return KVA_ERR_DOUBLE_FREE;
        if (freed) {
            __atomic_fetch_add(&reg->uncached_frees[ref.cls], 1, __ATOMIC_RELEASE);
            return KVA_OK;
        }
        /* Claimed meanwhile: the remote way, next time round. */
    }
}

void kva_tc_flush(kva_tc_registry *reg, kva_tcache *tc) {
    kva_slabs *sl = reg->slabs;
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        kva_tc_class *k = &tc->cls[c];
        while (k->nowned) {
            uint32_t last = k->nowned - 1;
            give_back(sl, tc, c, k->slab[last], k->word[last]);
            remove_owned(tc, c, last);
        }
    }
    kva_assert_expensive(kva_tc_check_cache(reg, tc, NULL) == KVA_OK);
}

void kva_tc_init_classes(kva_tcache *tc, const kva_slabs *sl) {
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        kva_tc_class *k = &tc->cls[c];
        tc->hot[c].size = sl->geom[c].size;
        uint64_t span = 64 * tc->hot[c].size, words = span ? KVA_TC_BYTES / span : KVA_TC_MIN_WORDS;
        k->limit = (uint32_t)(words < KVA_TC_MIN_WORDS ? KVA_TC_MIN_WORDS
                              : words > KVA_TC_WORDS   ? KVA_TC_WORDS
                                                       : words);
        no_current(tc, c);
    }
}
