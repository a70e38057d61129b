/*
 * pool_check.c — kva_check: walks every invariant stated in buddy.h, slab.h and pool.h and names
 * the first one broken. O(capacity / min_block + slab bitmap words); never on a hot path.
 */
#include <stdlib.h>

#include "checked_mode.h"
#include "pool.h"
#include "region_check.h"
#include "tcache.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

static kva_status check_tiling(const kva_buddy *b, uint64_t *free_units, uint64_t *used_units,
                               uint64_t *free_heads, uint64_t *used_blocks) {
    uint32_t index = 0;
    while (index < b->nblocks) {
        const kva_page *page = &b->pages[index];
        if (page->state == KVA_BLOCK_NONE || page->state > KVA_BLOCK_SLAB)
            return BROKEN("B1: minimum block %u should head a block but has state %u", index, page->state);
        if (page->order >= b->num_orders)
            return BROKEN("B1: block %u has order %u, beyond the %u orders", index, page->order, b->num_orders);
        uint32_t size = kva_buddy_length(page);
        if (index & (((uint32_t)1 << page->order) - 1))
            return BROKEN("B2: block %u of order %u is misaligned", index, page->order);
        if (size == 0 || size > (uint32_t)1 << page->order)
            return BROKEN("B1: block %u of order %u has length %u", index, page->order, size);
        if (size > b->nblocks - index) return BROKEN("B1: block %u of order %u runs past the end", index, page->order);
        for (uint32_t inner = index + 1; inner < index + size; inner++)
            if (b->pages[inner].state != KVA_BLOCK_NONE)
                return BROKEN("B1: minimum block %u inside block %u has state %u", inner, index, b->pages[inner].state);
        if (page->state == KVA_BLOCK_FREE) {
            *free_units += size;
            (*free_heads)++;
            uint32_t mate = index ^ size;
            if (page->order + 1u < b->num_orders && mate <= b->nblocks - size &&
                b->pages[mate].state == KVA_BLOCK_FREE && b->pages[mate].order == page->order)
                return BROKEN("B5: free buddies %u and %u of order %u were not merged", index, mate, page->order);
        } else {
            *used_units += size;
            *used_blocks += page->state == KVA_BLOCK_USED;
        }
        index += size;
    }
    return KVA_OK;
}

static kva_status check_free_lists(const kva_buddy *b, uint64_t free_heads) {
    uint64_t listed = 0;
    for (unsigned k = 0; k < KVA_MAX_ORDERS; k++) {
        int nonempty = (b->nonempty >> k) & 1;
        if (nonempty != (b->free_head[k] != KVA_NIL))
            return BROKEN("B4: nonempty bit %u is %d but free list %u is %s", k, nonempty, k,
                          b->free_head[k] == KVA_NIL ? "empty" : "not empty");
        uint64_t count = 0;
        uint32_t prev = KVA_NIL;
        for (uint32_t at = b->free_head[k]; at != KVA_NIL; at = b->pages[at].next) {
            if (at >= b->nblocks) return BROKEN("B3: free list %u links to %u, past the end", k, at);
            const kva_page *page = &b->pages[at];
            if (page->state != KVA_BLOCK_FREE || page->order != k)
                return BROKEN("B3: block %u on free list %u has state %u order %u", at, k, page->state, page->order);
            if (page->prev != prev) return BROKEN("B3: block %u on free list %u has a wrong prev link", at, k);
            if (++count > b->free_count[k])
                return BROKEN("B3: free list %u is longer than its count %llu", k,
                              (unsigned long long)b->free_count[k]);
            prev = at;
        }
        if (count != b->free_count[k])
            return BROKEN("B3: free list %u holds %llu blocks, its count says %llu", k, (unsigned long long)count,
                          (unsigned long long)b->free_count[k]);
        listed += count;
    }
    if (listed != free_heads)
        return BROKEN("B3: %llu free blocks in the heap but %llu on the free lists", (unsigned long long)free_heads,
                      (unsigned long long)listed);
    return KVA_OK;
}

static kva_status check_buddy(const kva_buddy *b, uint64_t *used_blocks) {
    uint64_t free_units = 0, used_units = 0, free_heads = 0;
    kva_status st = check_tiling(b, &free_units, &used_units, &free_heads, used_blocks);
    if (st != KVA_OK) return st;
    st = check_free_lists(b, free_heads);
    if (st != KVA_OK) return st;
    if (free_units != b->free_units || used_units != b->used_units)
        return BROKEN("B6: counted %llu free and %llu used minimum blocks, the counters say %llu and %llu",
                      (unsigned long long)free_units, (unsigned long long)used_units,
                      (unsigned long long)b->free_units, (unsigned long long)b->used_units);
    return KVA_OK;
}

/* S2 for slab s; adds the free bits of its owned words to *in_caches (S5: an owned word's
 * objects all count in inuse; a remote bit is a free not counted yet, its object still live in
 * both the counts and inuse). */
static kva_status check_bitmap(const kva_slabs *sl, uint32_t s, const kva_class_geometry *g, uint64_t *in_caches) {
    const kva_slab *slab = &sl->slabs[s];
    const uint64_t *l1 = kva_slab_bitmap(sl, s), *l0 = slab->l0, *remote = kva_slab_remote(slab, g);
    const uint32_t *owner = kva_slab_owner(slab, g);
    uint64_t free_bits = 0;
    for (uint32_t w = 0; w < g->l0_words; w++) {
        uint64_t bits = kva_load(&l0[w]);
        int owned = kva_load(&owner[w]) != KVA_NO_OWNER, listed = (l1[w >> 6] >> (w & 63)) & 1;
        if (owned) {
            *in_caches += (uint64_t)__builtin_popcountll(bits);
            if (listed) return BROKEN("S2: slab %u lists word %u in l1 though a thread cache owns it", s, w);
            continue;
        }
        free_bits += (uint64_t)__builtin_popcountll(bits);
        if ((bits != 0) != listed) return BROKEN("S2: slab %u l1 bit %u disagrees with its l0 word", s, w);
    }
    /* The last l1 word's bits past the l0 words: a claim would take such a "word", which lies
     * over the remote words. */
    if (g->l0_words % 64 && (l1[g->l1_words - 1] >> (g->l0_words % 64)))
        return BROKEN("S2: slab %u's l1 lists words past its %u l0 words", s, g->l0_words);
    uint32_t tail = g->nobj % 64;
    if (tail && ((kva_load(&l0[g->l0_words - 1]) | kva_load(&remote[g->l0_words - 1])) >> tail))
        return BROKEN("S2: slab %u marks objects past its %u objects free", s, g->nobj);
    for (uint32_t w = 0; w < g->l1_words; w++)
        if ((l1[w] != 0) != ((slab->l2 >> w) & 1)) return BROKEN("S2: slab %u l2 bit %u disagrees with its l1 word", s, w);
    if (g->l1_words < 64 && (slab->l2 >> g->l1_words))
        return BROKEN("S2: slab %u l2 has bits past its %u l1 words", s, g->l1_words);
    if (free_bits != g->nobj - slab->inuse)
        return BROKEN("S2: slab %u has %llu free objects in words no thread owns but %u of %u in use", s,
                      (unsigned long long)free_bits, slab->inuse, g->nobj);
    return KVA_OK;
}

/* S6 for a cache's free window: closed, or on a run of whole words of one slab that the cache
 * owns, with that slab's division magic, the run's first remote word and the counter of the
 * slab's class. (Where it sits among the windows is a hint, so anywhere will do.) */
static int window_is_sound(const kva_pool *pool, const kva_tcache *tc, const kva_tc_window *win) {
    const kva_slabs *sl = &pool->slabs;
    if (win->span == 0) return 1;
    uint64_t offset = (uint64_t)(win->base - (uintptr_t)pool->base);
    if (win->base < (uintptr_t)pool->base || offset >= pool->capacity || win->frees < tc->frees ||
        win->frees >= tc->frees + KVA_NUM_SIZE_CLASSES)
        return 0;
    uint32_t s = (uint32_t)(offset >> sl->chunk_shift);
    const kva_slab *slab = &sl->slabs[s];
    unsigned c = (unsigned)(win->frees - tc->frees);
    if (s >= sl->nchunks || slab->cls != c) return 0;
    const kva_class_geometry *g = &sl->geom[c];
    if (win->l0 < slab->l0 || win->l0 >= slab->l0 + g->l0_words) return 0;
    uint32_t first = (uint32_t)(win->l0 - slab->l0);
    if (win->span % g->size != 0) return 0;
    uint64_t objects = win->span / g->size, last = first + (objects + 63) / 64 - 1;
    uint64_t end = (last + 1) * 64;
    if (last >= g->l0_words || objects != (end < g->nobj ? end : g->nobj) - (uint64_t)first * 64) return 0;
    for (uint64_t w = first; w <= last; w++)
        if (kva_slab_owner(slab, g)[w] != tc->id) return 0;
    return win->base == (uintptr_t)pool->base + ((uint64_t)s << sl->chunk_shift) + (uint64_t)first * 64 * g->size &&
           win->remote == kva_slab_remote(slab, g) + first && win->magic == g->magic;
}

/* S6: every cache's owned words carry its id, and the owner entries of all slabs number exactly
 * the words the caches list; a cache's current words and free window are words it owns. Only
 * while no other thread holds a cache: owners change their sets without a lock. */
static kva_status check_caches(const kva_pool *pool, uint64_t owned_entries) {
    const kva_slabs *sl = &pool->slabs;
    uint64_t listed = 0;
    uint32_t caches = 0;
    const kva_tc_registry *reg = &pool->caches;
    for (const kva_tcache *tc = reg->caches; tc; tc = tc->pool_next) {
        if (++caches > reg->ncaches) return BROKEN("S6: the pool's list of thread caches is longer than its %u caches", reg->ncaches);
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
                    kva_slab_owner(&sl->slabs[s], g)[w] != tc->id)
                    return BROKEN("S6: thread cache %u lists word %u of slab %u for class %u, which it does not own",
                                  tc->id, w, s, c);
                if (k->cur == i && (h->l0 != sl->slabs[s].l0 + w || h->remote != kva_slab_remote(&sl->slabs[s], g) + w ||
                                    h->addr != pool->base + ((uint64_t)s << sl->chunk_shift) + (uint64_t)w * 64 * g->size))
                    return BROKEN("S6: thread cache %u's current word of class %u points elsewhere", tc->id, c);
                listed++;
            }
            /* Compared, never read through: a corrupted pointer must not crash the check. */
            if (k->cur == KVA_NIL && (h->l0 != kva_tc_no_word() || h->remote != kva_tc_no_word()))
                return BROKEN("S6: thread cache %u has no current word of class %u but allocates from one", tc->id, c);
        }
        for (unsigned i = 0; i < KVA_TC_WINDOWS; i++)
            if (!window_is_sound(pool, tc, &tc->windows[i]))
                return BROKEN("S6: thread cache %u's free window %u is not on a run of words it owns, as they are",
                              tc->id, i);
    }
    if (caches != reg->ncaches)
        return BROKEN("S6: the pool's list of thread caches holds %u of its %u caches", caches, reg->ncaches);
    if (listed != owned_entries)
        return BROKEN("S6: %llu words carry an owner but the thread caches list %llu", (unsigned long long)owned_entries,
                      (unsigned long long)listed);
    return KVA_OK;
}

static uint64_t owned_words(const kva_slabs *sl, uint32_t s, const kva_class_geometry *g) {
    uint64_t n = 0;
    for (uint32_t w = 0; w < g->l0_words; w++) n += kva_load(&kva_slab_owner(&sl->slabs[s], g)[w]) != KVA_NO_OWNER;
    return n;
}

/* S3 and S4 for one arena's lists of class c. */
static kva_status check_lists(const kva_slabs *sl, unsigned a, unsigned c, uint64_t slabs_here, uint64_t flagged) {
    const kva_arena_class *ac = &sl->arenas[a].classes[c];
    uint64_t count = 0;
    uint32_t prev = KVA_NIL;
    for (uint32_t at = ac->partial_head; at != KVA_NIL; at = sl->slabs[at].next) {
        if (at >= sl->nchunks || sl->slabs[at].cls != c || sl->slabs[at].arena != a)
            return BROKEN("S3: arena %u's partial list of class %u links to %u, not one of its slabs", a, c, at);
        if (sl->slabs[at].prev != prev) return BROKEN("S3: slab %u on arena %u's class %u list has a wrong prev link", at, a, c);
        if (!sl->slabs[at].listed) return BROKEN("S3: slab %u is on a partial list but not flagged listed", at);
        if (++count > slabs_here) return BROKEN("S3: arena %u's partial list of class %u loops", a, c);
        prev = at;
    }
    if (count != flagged)
        return BROKEN("S3: arena %u's partial list of class %u holds %llu slabs but %llu are flagged listed", a, c,
                      (unsigned long long)count, (unsigned long long)flagged);
    if (ac->partial_tail != prev)
        return BROKEN("S3: arena %u's partial tail of class %u is %u, the list ends at %u", a, c, ac->partial_tail, prev);
    if (ac->empty_slab != KVA_NIL && (ac->empty_slab >= sl->nchunks || sl->slabs[ac->empty_slab].cls != c ||
                                      sl->slabs[ac->empty_slab].arena != a))
        return BROKEN("S4: arena %u names spare %u for class %u, which is not one of its slabs", a, ac->empty_slab, c);
    if (ac->slabs != slabs_here)
        return BROKEN("S5: arena %u counts %u slabs of class %u; %llu exist", a, ac->slabs, c, (unsigned long long)slabs_here);
    return KVA_OK;
}

static kva_status check_slabs(const kva_pool *pool, const kva_tc_totals *totals) {
    const kva_slabs *sl = &pool->slabs;
    const kva_buddy *b = &pool->buddy;
    uint64_t live[KVA_NUM_SIZE_CLASSES] = {0}, in_caches[KVA_NUM_SIZE_CLASSES] = {0}, owned = 0;
    uint32_t total = 0;
    size_t cells = (size_t)sl->narenas * KVA_NUM_SIZE_CLASSES;
    uint64_t *per_arena = calloc(2 * cells, sizeof *per_arena), *flagged = per_arena + cells;
    if (!per_arena) return kva_fail(KVA_ERR_NOMEM, "no host memory to check the slabs");
    kva_status st = KVA_OK;
    for (uint32_t s = 0; s < sl->nchunks && st == KVA_OK; s++) {
        const kva_slab *slab = &sl->slabs[s];
        uint64_t head = (uint64_t)s << sl->chunk_order;
        int is_slab_block = head < b->nblocks && b->pages[head].state == KVA_BLOCK_SLAB;
        if ((slab->cls != KVA_SLAB_NONE) != is_slab_block) {
            st = BROKEN("S1: chunk %u descriptor says %s but its buddy block says %s", s,
                        slab->cls == KVA_SLAB_NONE ? "no slab" : "slab", is_slab_block ? "slab" : "no slab");
            break;
        }
        if (slab->cls == KVA_SLAB_NONE) continue;
        if (slab->cls >= KVA_NUM_SIZE_CLASSES) st = BROKEN("S1: slab %u has class %u", s, slab->cls);
        else if (slab->arena >= sl->narenas) st = BROKEN("S1: slab %u belongs to arena %u of %u", s, slab->arena, sl->narenas);
        else if (b->pages[head].order != sl->chunk_order)
            st = BROKEN("S1: slab %u sits in a block of order %u, not %u", s, b->pages[head].order, sl->chunk_order);
        if (st != KVA_OK) break;
        const kva_class_geometry *g = &sl->geom[slab->cls];
        if (slab->l0 != kva_slab_bitmap(sl, s) + g->l1_words) {
            st = BROKEN("S1: slab %u's l0 pointer is not inside its own bitmap slot", s);
            break;
        }
        if (slab->size != g->size || slab->nobj != g->nobj || slab->magic != g->magic || slab->l0_words != g->l0_words) {
            st = BROKEN("S1: slab %u's copy of its class's geometry disagrees with class %u", s, slab->cls);
            break;
        }
        if (slab->inuse > g->nobj) {
            st = BROKEN("S2: slab %u has %u of %u objects in use", s, slab->inuse, g->nobj);
            break;
        }
        st = check_bitmap(sl, s, g, &in_caches[slab->cls]);
        if (st != KVA_OK) break;
        owned += owned_words(sl, s, g);
        live[slab->cls] += slab->inuse;
        per_arena[(size_t)slab->arena * KVA_NUM_SIZE_CLASSES + slab->cls]++;
        total++;
        const kva_arena_class *ac = &sl->arenas[slab->arena].classes[slab->cls];
        if (slab->inuse == 0 && ac->empty_slab != s)
            st = BROKEN("S4: slab %u of class %u is empty but its arena's spare is %u", s, slab->cls, ac->empty_slab);
        else if (slab->inuse < g->nobj && !slab->listed)
            st = BROKEN("S3: slab %u has free objects but is on no partial list", s);
        flagged[(size_t)slab->arena * KVA_NUM_SIZE_CLASSES + slab->cls] += slab->listed;
    }
    for (unsigned a = 0; a < sl->narenas && st == KVA_OK; a++)
        for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES && st == KVA_OK; c++)
            st = check_lists(sl, a, c, per_arena[(size_t)a * KVA_NUM_SIZE_CLASSES + c],
                             flagged[(size_t)a * KVA_NUM_SIZE_CLASSES + c]);
    free(per_arena);
    if (st != KVA_OK) return st;
    if (total != sl->live_slabs) return BROKEN("S5: %u slabs exist, the counter says %u", total, sl->live_slabs);
    if (totals->foreign_caches) return KVA_OK; /* S5 and S6 need the other threads' caches still */
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++)
        if (totals->allocs[c] - totals->frees[c] != live[c] - in_caches[c])
            return BROKEN("S5: class %u counts %llu live objects; its slabs hold %llu", c,
                          (unsigned long long)(totals->allocs[c] - totals->frees[c]),
                          (unsigned long long)(live[c] - in_caches[c]));
    return check_caches(pool, owned);
}
typedef struct poison_check {
    const unsigned char *base;
    uint64_t bad_at; /* UINT64_MAX while every free byte holds the poison */
} poison_check;

static int check_free_range(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    poison_check *pc = ctx;
    size_t bad;
    if ((kind == KVA_WALK_FREE || kind == KVA_WALK_SLAB_FREE) &&
        !kva_holds(pc->base + offset, size, KVA_POISON_FREE, &bad)) {
        pc->bad_at = offset + bad;
        return 1;
    }
    return 0;
}

static kva_status check_locked(kva_pool *pool);

/* Every lock, so that nothing but the threads' own words moves while the invariants are read.
 * The counts that locking and every walk below rely on are checked first: the arenas (whose
 * locks are taken) and the slab descriptors (one per chunk of the capacity). */
kva_status kva_check(kva_pool *pool) {
    if (!pool) return kva_fail(KVA_ERR_INVALID, "pool is NULL");
    const kva_slabs *sl = &pool->slabs;
    if (sl->narenas == 0 || sl->narenas > KVA_MAX_ARENAS)
        return BROKEN("P4: the pool counts %u arenas, not 1 .. %d", sl->narenas, KVA_MAX_ARENAS);
    uint64_t bytes = (uint64_t)pool->buddy.nblocks << pool->buddy.min_shift; /* P2 checks capacity against it */
    if (sl->chunk_shift >= 64 || sl->nchunks != (bytes + ((uint64_t)1 << sl->chunk_shift) - 1) >> sl->chunk_shift)
        return BROKEN("P4: the pool counts %u slab descriptors for %llu bytes in chunks of 2^%u", sl->nchunks,
                      (unsigned long long)bytes, sl->chunk_shift);
    kva_pool_lock_all(pool);
    kva_status st = check_locked(pool);
    kva_pool_unlock_all(pool);
    return st;
}

static kva_status check_locked(kva_pool *pool) {
    if (pool->capacity != (size_t)pool->buddy.nblocks << pool->buddy.min_shift || pool->capacity > pool->region.length)
        return BROKEN("P2: capacity %zu disagrees with %u blocks or the %zu-byte region", pool->capacity,
                      pool->buddy.nblocks, pool->region.length);
    if ((uintptr_t)pool->base & (pool->max_alloc_size - 1))
        return BROKEN("P1: base %p is not aligned to the largest block (%zu)", (void *)pool->base, pool->max_alloc_size);
    uint64_t used_blocks = 0;
    kva_status st = check_buddy(&pool->buddy, &used_blocks);
    if (st != KVA_OK) return st;
    kva_tc_totals totals;
    kva_tc_totals_locked(&pool->caches, &totals);
    st = check_slabs(pool, &totals);
    if (st != KVA_OK) return st;
    if (pool->checked) {
        poison_check pc = {.base = pool->base, .bad_at = UINT64_MAX};
        kva_walk_locked(pool, check_free_range, &pc);
        if (pc.bad_at != UINT64_MAX)
            return BROKEN("C1: byte %llu of the pool is free but was written after it was freed",
                          (unsigned long long)pc.bad_at);
        if (pool->quarantined)
            return BROKEN("C2: %u blocks are withheld, each written after it was freed (the first at byte %llu)",
                          pool->quarantined, (unsigned long long)pool->quarantine[0]);
    }
    if (pool->block_allocs - pool->block_frees != used_blocks)
        return BROKEN("P3: %llu block allocations less %llu frees, but %llu blocks are live",
                      (unsigned long long)pool->block_allocs, (unsigned long long)pool->block_frees,
                      (unsigned long long)used_blocks);
    return kva_region_check(&pool->region, &pool->buddy);
}
