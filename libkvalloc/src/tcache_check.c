/*
 * tcache_check.c — the thread caches' side of S6 (slab.h), walked: kva_check runs it over every
 * cache of a pool, and an expensive assertion over a thread's own cache after a refill, a claim
 * or a flush.
 */
#include "tcache.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

/* A cache's free window: closed, or on a run of whole words of one slab that the cache owns,
 * with that slab's division magic, the run's first remote word and the counter of the slab's
 * class. (Where it sits among the windows is a hint, so anywhere will do.) */
static int window_is_sound(const kva_tc_registry *reg, const kva_tcache *tc, const kva_tc_window *win) {
    const kva_slabs *sl = reg->slabs;
    if (win->span == 0) return 1;
    uint64_t offset = (uint64_t)(win->base - (uintptr_t)reg->base);
    if (win->base < (uintptr_t)reg->base || offset >> sl->chunk_shift >= sl->nchunks || win->frees < tc->frees ||
        win->frees >= tc->frees + KVA_NUM_SIZE_CLASSES)
        return 0;
    uint32_t s = (uint32_t)(offset >> sl->chunk_shift);
    const kva_slab *slab = &sl->slabs[s];
    unsigned c = (unsigned)(win->frees - tc->frees);
    if (slab->cls != c) return 0;
    const kva_class_geometry *g = &sl->geom[c];
    if (win->l0 < slab->l0 || win->l0 >= slab->l0 + g->l0_words) return 0;
    uint32_t first = (uint32_t)(win->l0 - slab->l0);
    if (win->span % g->size != 0) return 0;
    uint64_t objects = win->span / g->size, last = first + (objects + 63) / 64 - 1;
    uint64_t end = (last + 1) * 64;
    if (last >= g->l0_words || objects != (end < g->nobj ? end : g->nobj) - (uint64_t)first * 64) return 0;
    for (uint64_t w = first; w <= last; w++)
        if (kva_load(&kva_slab_owner(slab, g)[w]) != tc->id) return 0;
    return win->base == (uintptr_t)reg->base + ((uint64_t)s << sl->chunk_shift) + (uint64_t)first * 64 * g->size &&
           win->remote == kva_slab_remote(slab, g) + first && win->magic == g->magic;
}

kva_status kva_tc_check_cache(const kva_tc_registry *reg, const kva_tcache *tc, uint64_t *listed) {
    const kva_slabs *sl = reg->slabs;
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        const kva_tc_class *k = &tc->cls[c];
        const kva_tc_hot *h = &tc->hot[c];
        if (h->size != sl->geom[c].size)
            return BROKEN("S6: thread cache %u's object size of class %u is %llu, not %u", tc->id, c,
                          (unsigned long long)h->size, sl->geom[c].size);
        if (k->nowned > k->limit || k->limit > KVA_TC_WORDS || (k->cur != KVA_NIL && k->cur >= k->nowned) ||
            (k->cur == KVA_NIL && k->nowned > 1))
            return BROKEN("S6: thread cache %u holds %u words of class %u, current %u", tc->id, k->nowned, c, k->cur);
        for (uint32_t i = 0; i < k->nowned; i++) {
            uint32_t s = k->slab[i], w = k->word[i];
            const kva_class_geometry *g = &sl->geom[c];
            if (s >= sl->nchunks || sl->slabs[s].cls != c || w >= g->l0_words ||
                kva_load(&kva_slab_owner(&sl->slabs[s], g)[w]) != tc->id)
                return BROKEN("S6: thread cache %u lists word %u of slab %u for class %u, which it does not own",
                              tc->id, w, s, c);
            if (k->cur == i && (h->l0 != sl->slabs[s].l0 + w || h->remote != kva_slab_remote(&sl->slabs[s], g) + w ||
                                h->addr != reg->base + ((uint64_t)s << sl->chunk_shift) + (uint64_t)w * 64 * g->size))
                return BROKEN("S6: thread cache %u's current word of class %u points elsewhere", tc->id, c);
            if (listed) (*listed)++;
        }
        /* Compared, never read through: a corrupted pointer must not crash the check. */
        if (k->cur == KVA_NIL && (h->l0 != kva_tc_no_word() || h->remote != kva_tc_no_word()))
            return BROKEN("S6: thread cache %u has no current word of class %u but allocates from one", tc->id, c);
    }
    for (unsigned i = 0; i < KVA_TC_WINDOWS; i++)
        if (!window_is_sound(reg, tc, &tc->windows[i]))
            return BROKEN("S6: thread cache %u's free window %u is not on a run of words it owns, as they are", tc->id,
                          i);
    return KVA_OK;
}

kva_status kva_tc_check_caches(const kva_tc_registry *reg, uint64_t *listed) {
    uint32_t caches = 0;
    for (const kva_tcache *tc = reg->caches; tc; tc = tc->pool_next) {
        if (++caches > reg->ncaches)
            return BROKEN("S6: the pool's list of thread caches is longer than its %u caches", reg->ncaches);
        kva_status st = kva_tc_check_cache(reg, tc, listed);
        if (st != KVA_OK) return st;
    }
    if (caches != reg->ncaches)
        return BROKEN("S6: the pool's list of thread caches holds %u of its %u caches", caches, reg->ncaches);
    return KVA_OK;
}
