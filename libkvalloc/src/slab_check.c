/*
 * slab_check.c — the slabs' invariants (slab.h, S1-S4), walked one slab and one arena list at a
 * time: kva_check runs them over every slab and list, and an expensive assertion runs them on a
 * slab just claimed from and on an arena's list after a slab is made or released there. Counts
 * across slabs (S5) and the caches' side (S6) are kva_check's.
 */
#include "slab.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

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
        if ((l1[w] != 0) != ((slab->l2 >> w) & 1))
            return BROKEN("S2: slab %u l2 bit %u disagrees with its l1 word", s, w);
    if (g->l1_words < 64 && (slab->l2 >> g->l1_words))
        return BROKEN("S2: slab %u l2 has bits past its %u l1 words", s, g->l1_words);
    if (free_bits != g->nobj - slab->inuse)
        return BROKEN("S2: slab %u has %llu free objects in words no thread owns but %u of %u in use", s,
                      (unsigned long long)free_bits, slab->inuse, g->nobj);
    return KVA_OK;
}

static uint64_t owned_words(const kva_slabs *sl, uint32_t s, const kva_class_geometry *g) {
    uint64_t n = 0;
    for (uint32_t w = 0; w < g->l0_words; w++) n += kva_load(&kva_slab_owner(&sl->slabs[s], g)[w]) != KVA_NO_OWNER;
    return n;
}

kva_status kva_slab_check(const kva_slabs *sl, uint32_t s, uint64_t *in_caches, uint64_t *owned) {
    const kva_slab *slab = &sl->slabs[s];
    const kva_buddy *b = sl->buddy;
    uint64_t head = (uint64_t)s << sl->chunk_order;
    int is_slab_block = head < b->nblocks && b->pages[head].state == KVA_BLOCK_SLAB;
    if ((slab->cls != KVA_SLAB_NONE) != is_slab_block)
        return BROKEN("S1: chunk %u descriptor says %s but its buddy block says %s", s,
                      slab->cls == KVA_SLAB_NONE ? "no slab" : "slab", is_slab_block ? "slab" : "no slab");
    if (slab->cls == KVA_SLAB_NONE) return KVA_OK;
    if (slab->cls >= KVA_NUM_SIZE_CLASSES) return BROKEN("S1: slab %u has class %u", s, slab->cls);
    if (slab->arena >= sl->narenas) return BROKEN("S1: slab %u belongs to arena %u of %u", s, slab->arena, sl->narenas);
    if (b->pages[head].order != sl->chunk_order)
        return BROKEN("S1: slab %u sits in a block of order %u, not %u", s, b->pages[head].order, sl->chunk_order);
    const kva_class_geometry *g = &sl->geom[slab->cls];
    if (slab->l0 != kva_slab_bitmap(sl, s) + g->l1_words)
        return BROKEN("S1: slab %u's l0 pointer is not inside its own bitmap slot", s);
    if (slab->size != g->size || slab->nobj != g->nobj || slab->magic != g->magic || slab->l0_words != g->l0_words)
        return BROKEN("S1: slab %u's copy of its class's geometry disagrees with class %u", s, slab->cls);
    if (slab->inuse > g->nobj) return BROKEN("S2: slab %u has %u of %u objects in use", s, slab->inuse, g->nobj);
    kva_status st = check_bitmap(sl, s, g, in_caches);
    if (st != KVA_OK) return st;
    *owned += owned_words(sl, s, g);
    const kva_arena_class *ac = &sl->arenas[slab->arena].classes[slab->cls];
    if (slab->inuse == 0 && ac->empty_slab != s)
        return BROKEN("S4: slab %u of class %u is empty but its arena's spare is %u", s, slab->cls, ac->empty_slab);
    if (slab->inuse < g->nobj && !slab->listed)
        return BROKEN("S3: slab %u has free objects but is on no partial list", s);
    return KVA_OK;
}

kva_status kva_slab_check_arena(const kva_slabs *sl, unsigned a, unsigned c, uint32_t s) {
    uint64_t unused = 0, listed;
    kva_status st = s == KVA_NIL ? KVA_OK : kva_slab_check(sl, s, &unused, &unused);
    return st != KVA_OK ? st : kva_slab_check_list(sl, a, c, &listed);
}

kva_status kva_slab_check_list(const kva_slabs *sl, unsigned a, unsigned c, uint64_t *listed) {
    const kva_arena_class *ac = &sl->arenas[a].classes[c];
    uint64_t count = 0;
    uint32_t prev = KVA_NIL;
    for (uint32_t at = ac->partial_head; at != KVA_NIL; at = sl->slabs[at].next) {
        if (at >= sl->nchunks || sl->slabs[at].cls != c || sl->slabs[at].arena != a)
            return BROKEN("S3: arena %u's partial list of class %u links to %u, not one of its slabs", a, c, at);
        if (sl->slabs[at].prev != prev)
            return BROKEN("S3: slab %u on arena %u's class %u list has a wrong prev link", at, a, c);
        if (!sl->slabs[at].listed) return BROKEN("S3: slab %u is on a partial list but not flagged listed", at);
        if (++count > sl->nchunks) return BROKEN("S3: arena %u's partial list of class %u loops", a, c);
        prev = at;
    }
    if (ac->partial_tail != prev)
        return BROKEN("S3: arena %u's partial tail of class %u is %u, the list ends at %u", a, c, ac->partial_tail,
                      prev);
    if (ac->empty_slab != KVA_NIL &&
        (ac->empty_slab >= sl->nchunks || sl->slabs[ac->empty_slab].cls != c || sl->slabs[ac->empty_slab].arena != a))
        return BROKEN("S4: arena %u names spare %u for class %u, which is not one of its slabs", a, ac->empty_slab, c);
    *listed = count;
    return KVA_OK;
}
