/*
 * slab.c — slab creation and release, claims and returns of words, list upkeep: the arena side
 * behind slab.h. Every function here runs under the lock of the arena concerned; growth and
 * release take the pool lock inside it for the buddy and the region.
 */
#include <stdlib.h>

#include "numa.h"
#include "os.h"
#include "slab.h"

static uint32_t words_for(uint64_t bits) { return (uint32_t)((bits + 63) / 64); }

kva_status kva_slabs_init(kva_slabs *sl, kva_buddy *buddy, size_t capacity, unsigned chunk_shift, unsigned narenas) {
    *sl = (kva_slabs){.chunk_shift = chunk_shift,
                      .chunk_mask = ((uint64_t)1 << chunk_shift) - 1,
                      .chunk_order = chunk_shift - buddy->min_shift,
                      .buddy = buddy};
    sl->nchunks = (uint32_t)((capacity + ((size_t)1 << chunk_shift) - 1) >> chunk_shift);
    size_t chunk = (size_t)1 << chunk_shift;
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        kva_class_geometry *g = &sl->geom[c];
        g->size = (uint32_t)kva_class_size(c);
        uint64_t nobj = chunk / g->size;
        g->nobj = (uint32_t)(nobj < KVA_SLAB_MAX_OBJECTS ? nobj : KVA_SLAB_MAX_OBJECTS);
        g->magic = kva_div_magic(g->size);
        g->l0_words = words_for(g->nobj);
        g->l1_words = words_for(g->l0_words);
        size_t words = kva_slot_words(g->l0_words, g->l1_words);
        if (words > sl->slot_words) sl->slot_words = words;
    }
    sl->arenas = aligned_alloc(64, (size_t)narenas * sizeof(kva_arena)); /* a cache line each */
    if (!sl->arenas) return kva_fail(KVA_ERR_NOMEM, "no host memory for %u arenas", narenas);
    sl->narenas = narenas;
    for (unsigned a = 0; a < narenas; a++) {
        kva_arena *arena = &sl->arenas[a];
        *arena = (kva_arena){.node = -1};
        pthread_mutex_init(&arena->lock, NULL);
        for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
            kva_arena_class *ac = &arena->classes[c];
            ac->partial_head = ac->partial_tail = ac->empty_slab = KVA_NIL;
        }
    }
    sl->slabs_bytes = (size_t)sl->nchunks * sizeof(kva_slab);
    sl->bitmaps_bytes = (size_t)sl->nchunks * sl->slot_words * sizeof(uint64_t);
    void *slabs, *bitmaps;
    kva_status st = kva_os_map_metadata(sl->slabs_bytes, &slabs);
    if (st != KVA_OK) goto fail_arenas;
    st = kva_os_map_metadata(sl->bitmaps_bytes, &bitmaps);
    if (st != KVA_OK) {
        kva_os_unmap(slabs, sl->slabs_bytes);
        goto fail_arenas;
    }
    sl->slabs = slabs;
    sl->bitmaps = bitmaps;
    for (uint32_t s = 0; s < sl->nchunks; s++) sl->slabs[s].cls = KVA_SLAB_NONE;
    return KVA_OK;

fail_arenas:
    for (unsigned a = 0; a < narenas; a++) pthread_mutex_destroy(&sl->arenas[a].lock);
    free(sl->arenas);
    sl->arenas = NULL;
    return st;
}

void kva_slabs_fini(kva_slabs *sl) {
    kva_os_unmap(sl->slabs, sl->slabs_bytes);
    kva_os_unmap(sl->bitmaps, sl->bitmaps_bytes);
    for (unsigned a = 0; a < sl->narenas; a++) pthread_mutex_destroy(&sl->arenas[a].lock);
    free(sl->arenas);
    sl->slabs = NULL;
    sl->bitmaps = NULL;
    sl->arenas = NULL;
}

/* Sets the low n bits of every word in words[0 .. ceil(n/64)) and clears the rest. */
static void fill_bits(uint64_t *words, uint64_t n) {
    uint32_t full = (uint32_t)(n / 64);
    for (uint32_t w = 0; w < full; w++) kva_store(&words[w], ~(uint64_t)0);
    if (n % 64) kva_store(&words[full], ((uint64_t)1 << (n % 64)) - 1);
}

static kva_arena_class *arena_class(kva_slabs *sl, uint32_t s) {
    return &sl->arenas[sl->slabs[s].arena].classes[sl->slabs[s].cls];
}

/* An arena's partial list for a class, doubly linked through the slab descriptors. A new slab
 * goes to the head, where claims come from. */
static void list_push_head(kva_slabs *sl, kva_arena_class *ac, uint32_t s) {
    kva_slab *slab = &sl->slabs[s];
    kva_assert_internal(!slab->listed);
    slab->prev = KVA_NIL;
    slab->next = ac->partial_head;
    if (ac->partial_head != KVA_NIL) sl->slabs[ac->partial_head].prev = s;
    else ac->partial_tail = s;
    ac->partial_head = s;
    slab->listed = 1;
}

static void list_push_tail(kva_slabs *sl, kva_arena_class *ac, uint32_t s) {
    kva_slab *slab = &sl->slabs[s];
    kva_assert_internal(!slab->listed);
    slab->next = KVA_NIL;
    slab->prev = ac->partial_tail;
    if (ac->partial_tail != KVA_NIL) sl->slabs[ac->partial_tail].next = s;
    else ac->partial_head = s;
    ac->partial_tail = s;
    slab->listed = 1;
}

static void list_unlink(kva_slabs *sl, kva_arena_class *ac, uint32_t s) {
    kva_slab *slab = &sl->slabs[s];
    kva_assert_internal(slab->listed);
    kva_assert_internal(slab->prev == KVA_NIL ? ac->partial_head == s : sl->slabs[slab->prev].next == s);
    kva_assert_internal(slab->next == KVA_NIL ? ac->partial_tail == s : sl->slabs[slab->next].prev == s);
    if (slab->prev != KVA_NIL) sl->slabs[slab->prev].next = slab->next;
    else ac->partial_head = slab->next;
    if (slab->next != KVA_NIL) sl->slabs[slab->next].prev = slab->prev;
    else ac->partial_tail = slab->prev;
    slab->listed = 0;
}

/* A new slab of class c for arena a at the head of its partial list; KVA_NIL if the buddy has
 * no chunk or no memory can back it (the caller then looks elsewhere, see tcache.c). */
static uint32_t grow(kva_slabs *sl, unsigned a, unsigned c) {
    pthread_mutex_lock(sl->pool_lock);
    uint32_t head = kva_buddy_alloc(sl->buddy, sl->chunk_order, KVA_BLOCK_SLAB);
    if (head == KVA_NIL) {
        pthread_mutex_unlock(sl->pool_lock);
        return KVA_NIL;
    }
    uint32_t s = head >> sl->chunk_order;
    kva_assert_internal(s < sl->nchunks && sl->slabs[s].cls == KVA_SLAB_NONE);
    uint64_t offset = (uint64_t)s << sl->chunk_shift;
    if (kva_unlikely(kva_region_commit(sl->region, offset, sl->chunk_mask + 1) != KVA_OK)) {
        kva_buddy_free(sl->buddy, head);
        pthread_mutex_unlock(sl->pool_lock);
        return KVA_NIL;
    }
    sl->live_slabs++;
    pthread_mutex_unlock(sl->pool_lock);

    const kva_class_geometry *g = &sl->geom[c];
    kva_slab *slab = &sl->slabs[s];
    kva_arena *arena = &sl->arenas[a];
    if (arena->node >= 0 && slab->bound_node != arena->node + 1) {
        /* Before the slab's first touch below (bitmaps are metadata; the chunk is not written). */
        if (kva_numa_bind(sl->region->base + offset, sl->chunk_mask + 1, arena->node, KVA_NUMA_PREFERRED) == KVA_OK)
            slab->bound_node = (uint16_t)(arena->node + 1);
        else arena->bind_failures++;
    }
    uint64_t *slot = kva_slab_bitmap(sl, s);
    fill_bits(slot, g->l0_words);
    kva_store(&slab->l0, slot + g->l1_words);
    fill_bits(slab->l0, g->nobj);
    for (uint32_t w = 0; w < g->l0_words; w++) {
        kva_store(&kva_slab_remote(slab, g)[w], 0);
        kva_store(&kva_slab_owner(slab, g)[w], KVA_NO_OWNER);
    }
    slab->l2 = g->l1_words == 64 ? ~(uint64_t)0 : ((uint64_t)1 << g->l1_words) - 1;
    slab->inuse = 0;
    slab->size = g->size;
    slab->nobj = g->nobj;
    slab->magic = g->magic;
    slab->l0_words = g->l0_words;
    kva_store(&slab->arena, (uint16_t)a);
    __atomic_store_n(&slab->cls, (uint8_t)c, __ATOMIC_RELEASE);
    kva_arena_class *ac = &sl->arenas[a].classes[c];
    list_push_head(sl, ac, s);
    ac->slabs++;
    return s;
}

static void release(kva_slabs *sl, uint32_t s) {
    kva_assert_internal(sl->slabs[s].inuse == 0);
    unsigned a = sl->slabs[s].arena, c = sl->slabs[s].cls;
    kva_arena_class *ac = arena_class(sl, s);
    if (sl->slabs[s].listed) list_unlink(sl, ac, s);
    if (ac->empty_slab == s) ac->empty_slab = KVA_NIL;
    ac->slabs--;
    __atomic_store_n(&sl->slabs[s].cls, (uint8_t)KVA_SLAB_NONE, __ATOMIC_RELEASE);
    pthread_mutex_lock(sl->pool_lock);
    sl->live_slabs--;
    kva_region_decommit(sl->region, (uint64_t)s << sl->chunk_shift, sl->chunk_mask + 1);
    kva_buddy_free(sl->buddy, s << sl->chunk_order);
    pthread_mutex_unlock(sl->pool_lock);
    kva_assert_expensive(kva_slab_check_arena(sl, a, c, KVA_NIL) == KVA_OK);
}

/* Slab s has just become empty. Its arena keeps one empty slab per class so that a batch that
 * frees everything and allocates again does not bounce a chunk through the buddy every round;
 * the spare named may have filled up since, and then s becomes the spare instead. */
static void emptied(kva_slabs *sl, uint32_t s) {
    kva_arena_class *ac = arena_class(sl, s);
    uint32_t spare = ac->empty_slab;
    if (spare != KVA_NIL && spare != s && sl->slabs[spare].inuse == 0) release(sl, s);
    else ac->empty_slab = s;
}

/* Word w of slab s has free objects and nobody owns it: l1 and l2 list it, and the slab. */
static void list_word(kva_slabs *sl, uint32_t s, uint32_t w) {
    kva_slab *slab = &sl->slabs[s];
    uint64_t *slot = kva_slab_bitmap(sl, s);
    slot[w >> 6] |= (uint64_t)1 << (w & 63);
    slab->l2 |= (uint64_t)1 << (w >> 6);
    if (!slab->listed) list_push_tail(sl, arena_class(sl, s), s);
}

unsigned kva_slab_claim_word(kva_slabs *sl, uint32_t s, uint32_t w, uint32_t owner, uint64_t freeing) {
    kva_slab *slab = &sl->slabs[s];
    const kva_class_geometry *g = &sl->geom[slab->cls];
    /* The bits first, the owner after (a release store): a remote free reads the owner, then
     * the object's bit, so one that finds this owner finds the objects freed here free too (a
     * double free, refused). A remote free that ORs into this word's remote bits just as it
     * changes hands either lands before the exchange below (merged now) or after it, and then
     * finds this owner, or finds no owner and takes this arena's lock, which is held here, and
     * then finds this owner: either way its bit waits for this owner's next merge. */
    uint64_t *l0 = &slab->l0[w];
    uint64_t before = kva_load(l0), *remote_word = &kva_slab_remote(slab, g)[w];
    kva_assert_internal(kva_load(&kva_slab_owner(slab, g)[w]) == KVA_NO_OWNER && (before & freeing) == 0);
    uint64_t remote = kva_load(remote_word) ? __atomic_exchange_n(remote_word, 0, __ATOMIC_ACQ_REL) : 0;
    kva_store(l0, before | remote | freeing);
    __atomic_store_n(&kva_slab_owner(slab, g)[w], owner, __ATOMIC_RELEASE);
    /* The word's objects all count as in use now; its remote ones were counted live already,
     * and so were the ones freed here. */
    slab->inuse += (uint32_t)__builtin_popcountll(before);
    uint64_t *slot = kva_slab_bitmap(sl, s);
    uint64_t l1 = slot[w >> 6];
    if (l1 >> (w & 63) & 1) {
        slot[w >> 6] = l1 &= ~((uint64_t)1 << (w & 63));
        if (l1 == 0) slab->l2 &= ~((uint64_t)1 << (w >> 6));
    }
    sl->arenas[slab->arena].claims++;
    /* The objects freed here are the caller's to count: a remote bit of one of them is a
     * second free that raced this one, passed on after the caller found the object live. */
    return kva_slab_newly_freed(remote, before | freeing);
}

int kva_slab_claim(kva_slabs *sl, unsigned a, unsigned c, uint32_t owner, int may_grow, uint32_t *slab_out,
                   uint32_t *word_out, uint64_t *merged) {
    kva_arena_class *ac = &sl->arenas[a].classes[c];
    uint32_t s;
    for (;;) {
        s = ac->partial_head;
        if (s == KVA_NIL) {
            if (!may_grow || (s = grow(sl, a, c)) == KVA_NIL) return 0;
        }
        if (sl->slabs[s].l2 != 0) break;
        list_unlink(sl, ac, s); /* full: every free object of an unowned word is listed */
    }
    kva_slab *slab = &sl->slabs[s];
    uint64_t *slot = kva_slab_bitmap(sl, s);
    unsigned i = kva_ctz64(slab->l2);
    uint32_t w = i * 64 + kva_ctz64(slot[i]);
    if (ac->empty_slab == s) ac->empty_slab = KVA_NIL; /* no longer empty once claimed */
    kva_add_release(merged, kva_slab_claim_word(sl, s, w, owner, 0));
    *slab_out = s;
    *word_out = w;
    kva_assert_expensive(kva_slab_check_arena(sl, a, c, s) == KVA_OK);
    return 1;
}

unsigned kva_slab_release_word(kva_slabs *sl, uint32_t s, uint32_t w) {
    kva_slab *slab = &sl->slabs[s];
    const kva_class_geometry *g = &sl->geom[slab->cls];
    kva_assert_internal(kva_load(&kva_slab_owner(slab, g)[w]) != KVA_NO_OWNER);
    /* The owner first, with a full fence, then the remote word: a remote free ORs, then reads
     * the owner; one of the two sides sees the other's write, so its bit is merged here or it
     * finds no owner and drains the bit itself under this arena's lock. */
    __atomic_store_n(&kva_slab_owner(slab, g)[w], KVA_NO_OWNER, __ATOMIC_SEQ_CST);
    uint64_t *l0 = &slab->l0[w], *remote_word = &kva_slab_remote(slab, g)[w];
    uint64_t bits = kva_load(l0);
    unsigned merged = 0;
    if (__atomic_load_n(remote_word, __ATOMIC_SEQ_CST)) {
        uint64_t passed = __atomic_exchange_n(remote_word, 0, __ATOMIC_ACQ_REL);
        merged = kva_slab_newly_freed(passed, bits);
        bits |= passed;
    }
    kva_store(l0, bits);
    if (bits == 0) return 0;
    slab->inuse -= (uint32_t)__builtin_popcountll(bits);
    list_word(sl, s, w);
    if (slab->inuse == 0) emptied(sl, s);
    return merged;
}

/* Frees `freed` (bits of live objects) in word w of slab s, which nobody owns. */
static void free_unowned(kva_slabs *sl, uint32_t s, uint32_t w, uint64_t freed) {
    kva_slab *slab = &sl->slabs[s];
    uint64_t *l0 = &slab->l0[w];
    kva_assert_internal((kva_load(l0) & freed) == 0 && slab->inuse >= (uint32_t)__builtin_popcountll(freed));
    kva_store(l0, kva_load(l0) | freed);
    slab->inuse -= (uint32_t)__builtin_popcountll(freed);
    list_word(sl, s, w);
    if (slab->inuse == 0) emptied(sl, s);
}

unsigned kva_slab_drain_remote(kva_slabs *sl, unsigned a, uint32_t s, uint32_t w, unsigned *cls) {
    kva_slab *slab = &sl->slabs[s];
    /* cls read once, with acquire: grow() stores arena before it publishes cls. */
    unsigned c = __atomic_load_n(&slab->cls, __ATOMIC_ACQUIRE);
    if (c == KVA_SLAB_NONE || kva_load(&slab->arena) != a) return 0;
    const kva_class_geometry *g = &sl->geom[c];
    if (w >= g->l0_words || __atomic_load_n(&kva_slab_owner(slab, g)[w], __ATOMIC_SEQ_CST) != KVA_NO_OWNER) return 0;
    *cls = c;
    uint64_t passed = __atomic_exchange_n(&kva_slab_remote(slab, g)[w], 0, __ATOMIC_ACQ_REL),
             free = kva_load(&slab->l0[w]);
    if (passed & ~free) free_unowned(sl, s, w, passed & ~free);
    return kva_slab_newly_freed(passed, free);
}

int kva_slab_free_in_unowned(kva_slabs *sl, uint32_t s, uint32_t w, uint64_t bit) {
    const kva_slab *slab = &sl->slabs[s];
    const kva_class_geometry *g = &sl->geom[slab->cls];
    if (__atomic_load_n(&kva_slab_owner(slab, g)[w], __ATOMIC_SEQ_CST) != KVA_NO_OWNER) return 0;
    free_unowned(sl, s, w, bit);
    return 1;
}

/* Returns arena a's empty slabs, the classes' spares, to the buddy (its lock held). */
static unsigned trim_arena(kva_slabs *sl, unsigned a) {
    unsigned released = 0;
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        kva_arena_class *ac = &sl->arenas[a].classes[c];
        uint32_t spare = ac->empty_slab;
        ac->empty_slab = KVA_NIL;
        if (spare != KVA_NIL && sl->slabs[spare].inuse == 0) {
            release(sl, spare);
            released++;
        }
    }
    return released;
}

unsigned kva_slab_trim(kva_slabs *sl) {
    unsigned released = 0;
    for (unsigned a = 0; a < sl->narenas; a++) {
        pthread_mutex_lock(&sl->arenas[a].lock);
        released += trim_arena(sl, a);
        pthread_mutex_unlock(&sl->arenas[a].lock);
    }
    return released;
}
