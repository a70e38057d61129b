/*
 * slab.h — small objects (16 B .. 64 KiB) in slabs: buddy chunks cut into equal objects.
 *
 * A slab is one buddy block of chunk size, so chunk number c (offset >> chunk_shift) names both
 * the chunk and its descriptor slabs[c]: finding an object's slab is one shift, no search.
 * Occupancy lives out of band in a three-level bitmap per slab (1 = free):
 *   l0: one bit per object;  l1: one bit per l0 word that has a free bit and no owner;
 *   l2: one bit per l1 word that has a set bit (one word: at most 2^18 objects per slab).
 * so the first free object is three ctz away whatever the slab's size.
 *
 * Threads own words. A thread cache (tcache.h) takes whole l0 words from an arena (arena.h):
 * the word's owner entry names the cache, and from then on only that thread writes the word,
 * with plain stores, no lock and no read-modify-write; allocation pops its lowest set bit, a
 * free sets the object's bit after checking it is clear, so a double free is caught exactly.
 * An owned word is the thread's cache of objects: out of band, its objects never written.
 * Another thread that frees an object of an owned word sets the object's bit in the word's
 * remote word instead (an atomic OR: lock-free, bounded, cannot overflow); the owner merges
 * the remote word into its word before it needs more objects and when it gives the word back.
 *
 * Slot of slab s (kva_slab_bitmap): l1[l1_words] | l0[l0_words] | remote[l0_words] |
 * owner[l0_words] (u32 each, 0 = nobody), sized for the class with the most words.
 *
 * A slab's inuse counts its live objects in words nobody owns plus every object of its owned
 * words, free or not. So claiming a word adds its free objects, giving it back subtracts them,
 * and neither allocating nor freeing inside an owned word changes any shared count.
 *
 * Invariants (kva_check verifies each; those marked * only while no other thread holds a cache
 * of the pool, since owners move them without a lock):
 *  S1  slabs[c].cls != KVA_SLAB_NONE iff the buddy block at chunk c is a SLAB head of chunk order;
 *      its arena is below the pool's arena count; its copies of the class geometry match.
 *  S2  The free bits of the words nobody owns number nobj - inuse; no bit at or beyond nobj is
 *      set, in l0 or remote; an l1 bit is set iff its l0 word is nonzero and has no owner; an
 *      l2 bit iff its l1 word is nonzero.
 *  S3  A slab is on its arena's partial list for its class iff its listed flag is set; every
 *      slab with a free bit in a word nobody owns is listed; the list is doubly linked. (A full
 *      slab leaves the list lazily, when a claim finds it at the head.)
 *  S4  At most one slab per class and arena is empty (inuse == 0), and then it is that arena
 *      class's empty_slab, which is KVA_NIL or a slab of the class in that arena.
 *  S5* A class's allocations less its counted frees equal the sum of inuse over its slabs less
 *      the free bits of owned words. (A free is counted when its object's bit reaches the word:
 *      a remote bit is a free still to count, whose object both sides still count live.)
 *  S6* Every owner entry names a live cache of the pool that lists the word among its own for
 *      that class, and every word a cache lists is owned by it in a slab of that class;
 *      a cache's current word of each class and its free window (tcache.h), when open, are
 *      words it lists, described as they are.
 */
#ifndef KVA_SLAB_H
#define KVA_SLAB_H

#include "arena.h"
#include "buddy.h"
#include "region.h"
#include "size_class.h"

#define KVA_SLAB_NONE 0xffu
#define KVA_SLAB_MAX_OBJECTS (1u << 18)
/* The quotient d / size and whether it is exact, for d < 2^32, from one 64 x 64 -> 128-bit
 * multiply by magic = kva_div_magic(size): the high half is the quotient, and size divides d iff
 * the low half is below magic (Lemire, Kaser and Kurz, "Faster remainder by direct
 * computation", Software: Practice and Experience 49(6), 2019). Offsets in a slab are below the
 * largest chunk, 64 MiB; test_size_class checks every class over every offset of a word and of
 * a 2 MiB slab. */
KVA_INLINE uint64_t kva_div_magic(uint64_t size) { return UINT64_MAX / size + 1; }

KVA_INLINE int kva_div_exact(uint64_t d, uint64_t magic, uint64_t *quotient) {
    unsigned __int128 product = (unsigned __int128)d * magic;
    *quotient = (uint64_t)(product >> 64);
    return (uint64_t)product < magic;
}
#define KVA_NO_OWNER 0u

typedef struct kva_slab {
    uint64_t *l0;        /* this slab's l0 words (inside its bitmap slot) */
    uint64_t l2;         /* bit i: l1 word i is nonzero */
    uint32_t prev, next; /* links of the arena's partial list for the class */
    uint32_t inuse;      /* see above: live objects of unowned words + all of owned words */
    uint8_t cls;         /* size class, or KVA_SLAB_NONE if the chunk is not a slab */
    uint8_t listed;      /* on the partial list */
    uint16_t arena;      /* the arena that grew it */
    uint16_t bound_node; /* 1 + the NUMA node its chunk is bound to, 0 if never bound */
    /* Copies of what the free fast path needs, set when the slab is made, so that it reads one
     * line of metadata besides the object's words: the class's size, object count, division
     * magic and l0 word count (the remote words follow l0, the owners follow the remote words). */
    uint32_t size, nobj;
    uint64_t magic; /* kva_div_magic(size) */
    uint32_t l0_words;
    /* A cache line each (most of it unused): every free reads its slab's descriptor, and a claim or
     * return of a word writes it; neighbouring slabs usually belong to different arenas, hence
     * threads on other cores, and sharing a line made two threads on two cores no faster than
     * one. */
} __attribute__((aligned(64))) kva_slab;

_Static_assert(sizeof(kva_slab) == 64, "a slab descriptor is one cache line");

/* What every slab of a class shares; fixed at pool creation, read by the fast paths. */
typedef struct kva_class_geometry {
    uint32_t size;
    uint32_t nobj;     /* objects per slab */
    uint64_t magic;    /* kva_div_magic(size) */
    uint32_t l0_words; /* l1 comes first in a slab's bitmap slot, l0 after it */
    uint32_t l1_words;
} kva_class_geometry;

typedef struct kva_slabs {
    kva_slab *slabs;   /* one descriptor per chunk of the pool (a partial tail chunk too) */
    uint64_t *bitmaps; /* slot_words words per chunk */
    /* every page of bitmaps faulted in at creation (pool.c); otherwise the kernel commits them as
     * slabs first touch them */
    int bitmaps_resident;
    size_t slot_words;
    uint32_t nchunks; /* descriptors */
    unsigned chunk_shift;
    uint64_t chunk_mask;  /* chunk size - 1 */
    unsigned chunk_order; /* the buddy order of one chunk */
    size_t slabs_bytes, bitmaps_bytes;
    kva_class_geometry geom[KVA_NUM_SIZE_CLASSES];
    kva_arena *arenas;
    unsigned narenas;
    uint32_t live_slabs; /* under the pool lock */
    /* The pool's: slab growth and release take a chunk from and give it to the buddy, and
     * commit or decommit its memory, under the pool lock. */
    kva_buddy *buddy;
    kva_region *region;
    pthread_mutex_t *pool_lock;
} kva_slabs;

kva_status kva_slabs_init(kva_slabs *sl, kva_buddy *buddy, size_t capacity, unsigned chunk_shift, unsigned narenas);
void kva_slabs_fini(kva_slabs *sl);

/* ---- the slot of a slab -------------------------------------------------------------------- */

KVA_INLINE uint64_t *kva_slab_bitmap(const kva_slabs *sl, uint32_t s) {
    return sl->bitmaps + (size_t)s * sl->slot_words;
}

KVA_INLINE uint64_t *kva_slab_remote(const kva_slab *slab, const kva_class_geometry *g) {
    return slab->l0 + g->l0_words;
}

KVA_INLINE uint32_t *kva_slab_owner(const kva_slab *slab, const kva_class_geometry *g) {
    return (uint32_t *)(slab->l0 + 2 * (size_t)g->l0_words);
}

/* The same two, through the descriptor's copy of the word count (one cache line, no geometry):
 * for the fast paths, which already hold the descriptor. */
KVA_INLINE uint64_t *kva_slab_remote_fast(const kva_slab *slab) { return slab->l0 + slab->l0_words; }

KVA_INLINE uint32_t *kva_slab_owner_fast(const kva_slab *slab) {
    return (uint32_t *)(slab->l0 + 2 * (size_t)slab->l0_words);
}

/* Words of a slot for a class with l0_words l0 words and l1_words l1 words. */
KVA_INLINE size_t kva_slot_words(uint32_t l0_words, uint32_t l1_words) {
    return (size_t)l1_words + 2 * (size_t)l0_words + ((size_t)l0_words + 1) / 2;
}

KVA_INLINE uint32_t kva_slab_chunk(const kva_slabs *sl, uint64_t offset) {
    return (uint32_t)(offset >> sl->chunk_shift);
}

/* Objects in word w of a slab of the class: 64, or fewer in the last word. */
KVA_INLINE unsigned kva_word_objects(const kva_class_geometry *g, uint32_t w) {
    uint32_t left = g->nobj - w * 64;
    return left < 64 ? left : 64;
}

/* Where an object lives: found from its pool offset. */
typedef struct kva_object_ref {
    uint32_t slab;
    uint32_t word; /* index of its l0 word */
    unsigned cls;
    uint64_t *l0; /* its l0 word */
    uint64_t bit; /* its bit in that word */
} kva_object_ref;

/* Finds the object that starts at pool offset `offset`, which lies in a slab chunk (the caller
 * checked). 0 if the offset is not an object's first byte. */
KVA_INLINE int kva_slab_locate(const kva_slabs *sl, uint64_t offset, kva_object_ref *ref) {
    uint32_t s = kva_slab_chunk(sl, offset);
    unsigned c = kva_load(&sl->slabs[s].cls);
    if (kva_unlikely(c >= KVA_NUM_SIZE_CLASSES)) return 0;
    const kva_class_geometry *g = &sl->geom[c];
    uint64_t rel = offset & sl->chunk_mask, object;
    if (kva_unlikely(!kva_div_exact(rel, g->magic, &object) || object >= g->nobj)) return 0;
    ref->slab = s;
    ref->word = (uint32_t)(object >> 6);
    ref->cls = c;
    ref->l0 = kva_load(&sl->slabs[s].l0) + ref->word;
    ref->bit = (uint64_t)1 << (object & 63);
    return 1;
}


/* Where the object's word keeps its remote frees and its owner. */
KVA_INLINE uint64_t *kva_ref_remote(const kva_slabs *sl, const kva_object_ref *ref) {
    return ref->l0 + sl->geom[ref->cls].l0_words;
}

KVA_INLINE uint32_t *kva_ref_owner(const kva_slabs *sl, const kva_object_ref *ref) {
    return (uint32_t *)(ref->l0 - ref->word + 2 * (size_t)sl->geom[ref->cls].l0_words) + ref->word;
}

/* Free in its word or passed to its owner and not merged yet: either way not live. */
KVA_INLINE int kva_slab_is_live(const kva_slabs *sl, const kva_object_ref *ref) {
    return !((kva_load(ref->l0) | kva_load(kva_ref_remote(sl, ref))) & ref->bit);
}

KVA_INLINE uint32_t kva_slab_owner_of(const kva_slabs *sl, const kva_object_ref *ref) {
    return __atomic_load_n(kva_ref_owner(sl, ref), __ATOMIC_SEQ_CST);
}

/* ---- words: the arena side (the slab's arena lock held) ------------------------------------ */

/* Claims a word with free objects of class c for owner from arena a's slabs, growing a slab
 * from the buddy when the arena has none (grow = 0: only slabs the arena has). Returns 1 with
 * the slab and word, 0 when there is none. Remote frees waiting in the word are merged into
 * it and added to *merged (the claiming thread's counter). */
int kva_slab_claim(kva_slabs *sl, unsigned a, unsigned c, uint32_t owner, int grow, uint32_t *slab, uint32_t *word,
                   uint64_t *merged);

/* Claims word w of slab s, which nobody owns, for owner, freeing the live objects `freeing`
 * of it first: their bits are in the word before its owner is, so a remote free that finds
 * the owner also finds them free. Returns how many objects the remote frees waiting in the
 * word freed (merged into it now). */
unsigned kva_slab_claim_word(kva_slabs *sl, uint32_t s, uint32_t w, uint32_t owner, uint64_t freeing);

/* Gives back word w of slab s, owned by the caller: its free objects (remote ones merged)
 * return to the slab and its arena. Returns how many objects the merged remote frees freed. */
unsigned kva_slab_release_word(kva_slabs *sl, uint32_t s, uint32_t w);

/* Frees the remote bits of word w of slab s if nobody owns it (a remote free that found the
 * word given back just as it passed the object on). The caller holds arena a's lock and read a
 * as the slab's arena before it passed the object on: by now the slab may have been emptied and
 * made anew elsewhere, and then there is nothing of the caller's left to drain; or made anew
 * in the same arena, maybe of another class, whose word it then drains. Returns how many
 * objects it freed, and their class in *cls (set only when it drained a word). */
unsigned kva_slab_drain_remote(kva_slabs *sl, unsigned a, uint32_t s, uint32_t w, unsigned *cls);

/* Frees the live object `bit` of word w of slab s if nobody owns the word (1); 0 if somebody
 * does, with nothing changed. For a thread that has no cache to free into. */
int kva_slab_free_in_unowned(kva_slabs *sl, uint32_t s, uint32_t w, uint64_t bit);

/* Returns every arena's empty slabs, the classes' spares, to the buddy, locking each arena in
 * turn (no lock held by the caller); how many went back. */
unsigned kva_slab_trim(kva_slabs *sl);

/* ---- checks (slab_check.c): KVA_OK, or KVA_ERR_CORRUPT naming what is broken --------------- */

/* Chunk s: no slab unless its buddy block is a SLAB head; a slab's descriptor and bitmaps (S1,
 * S2), and its place in its arena (S3, S4: listed when it has free objects, the spare when
 * empty). Adds the free bits of its owned words to *in_caches and its owned words to *owned.
 * The slab's arena lock held, or every lock. */
kva_status kva_slab_check(const kva_slabs *sl, uint32_t s, uint64_t *in_caches, uint64_t *owned);

/* What an expensive assertion checks after a slab is made (s: the slab) or released (s:
 * KVA_NIL) in arena a for class c: slab s and the arena's list of the class. The arena's lock
 * held. */
kva_status kva_slab_check_arena(const kva_slabs *sl, unsigned a, unsigned c, uint32_t s);

/* Arena a's partial list of class c (S3: links, members of that arena and class, each flagged
 * listed, no loop) and its spare (S4); its length in *listed. The arena's lock held. */
kva_status kva_slab_check_list(const kva_slabs *sl, unsigned a, unsigned c, uint64_t *listed);

/* ---- words: the owner side (no lock) ------------------------------------------------------- */

/* Remote frees are counted when their bits reach the object's word, by whoever merges them
 * there, not when they are passed on: a remote bit whose object is already free is a second
 * free of a racing pair (slab.h's caller, tcache.c) or one that landed in a slab released and
 * made anew meanwhile, and is never counted, so the counts stay exact whatever the races. The
 * functions that merge remote bits return, or add to *merged, how many objects they freed. */
KVA_INLINE unsigned kva_slab_newly_freed(uint64_t passed, uint64_t free_bits) {
    return (unsigned)__builtin_popcountll(passed & ~free_bits);
}

/* Merges the remote frees of an owned word into it, adding the objects they freed to *merged
 * (a counter only the calling thread, the word's owner, writes: a release store, so that a
 * reader of the count sees the objects' frees before it); returns the word's free bits. */
KVA_INLINE uint64_t kva_slab_merge_remote(uint64_t *l0, uint64_t *remote, uint64_t *merged) {
    uint64_t bits = kva_load(l0);
    if (kva_load(remote) == 0) return bits;
    uint64_t passed = __atomic_exchange_n(remote, 0, __ATOMIC_ACQ_REL);
    unsigned freed = kva_slab_newly_freed(passed, bits);
    bits |= passed;
    kva_store(l0, bits);
    kva_add_release(merged, freed);
    return bits;
}

#endif
