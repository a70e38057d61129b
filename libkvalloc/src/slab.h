/*
 * slab.h — small objects (16 B .. 64 KiB) in slabs: buddy chunks cut into equal objects.
 *
 * A slab is one buddy block of chunk size, so chunk number c (offset >> chunk_shift) names both
 * the chunk and its descriptor slabs[c]: finding an object's slab is one shift, no search.
 * Occupancy lives out of band in a three-level bitmap per slab (1 = free):
 *   l0: one bit per object;  l1: one bit per l0 word that has a free bit;
 *   l2: one bit per l1 word that has a set bit (one word: at most 2^18 objects per slab).
 * so the first free object is three ctz away whatever the slab's size.
 *
 * Each class claims one l0 word at a time (its "current word") and takes that word's bit out of
 * l1, so no other search finds it. Allocation then pops the lowest set bit of the current word:
 * a load, a ctz and a store. The three levels are walked only to claim the next word, once per
 * 64 objects at most. The l0 bits stay the truth about every object, claimed or not, so a
 * double free is caught the same way everywhere.
 *
 * A slab's inuse counts the free objects of a claimed word as in use from the claim on, and
 * gives them back when the word is given up. So neither allocating from the current word nor
 * freeing into it changes any slab count: the fast paths update one counter each.
 *
 * Invariants (kva_check verifies each):
 *  S1  slabs[c].cls != KVA_SLAB_NONE iff the buddy block at chunk c is a SLAB head of chunk order.
 *  S2  popcount(l0) == nobj - inuse + the free bits of the class's current word if it lies in
 *      this slab (inuse counts a claimed word's free objects as in use, see below); no bit at or
 *      beyond nobj is set; an l1 bit is set iff its l0 word is nonzero and not a class's current
 *      word; an l2 bit iff its l1 word is nonzero.
 *  S3  A slab is on its class's partial list iff its listed flag is set; every slab with a free
 *      object is listed; the list is doubly linked. (A full slab leaves the list lazily, when a
 *      claim finds it at the head, so the allocation fast path never touches the list.)
 *  S4  At most one slab per class is empty (inuse == 0), and then it is the class's empty_slab;
 *      empty_slab is KVA_NIL or a slab of the class (possibly no longer empty: checked lazily).
 *  S5  A class's allocs - frees equals the sum of inuse over its slabs less the free bits of its
 *      current word; slabs is its slab count.
 *  S6  A class's current word lies in one of its own slabs and cur_offset is that word's first
 *      object; with no current word, cur_l0 points at the always-zero no_word.
 */
#ifndef KVA_SLAB_H
#define KVA_SLAB_H

#include "buddy.h"
#include "region.h"
#include "size_class.h"

#define KVA_SLAB_NONE 0xffu
#define KVA_SLAB_MAX_OBJECTS (1u << 18)
/* Object index = (offset in slab * recip) >> KVA_RECIP_SHIFT, exact for offsets below 2^26 and
 * sizes up to 2^16 (offset * size < 2^42), and the product stays below 2^64. */
#define KVA_RECIP_SHIFT 42

typedef struct kva_slab {
    uint64_t *l0;         /* this slab's l0 words (inside its bitmap slot) */
    uint64_t l2;          /* bit i: l1 word i is nonzero */
    uint32_t prev, next;  /* links of the class's partial list */
    uint32_t inuse;       /* live objects, plus the free ones of a claimed word in this slab */
    uint8_t cls;          /* size class, or KVA_SLAB_NONE if the chunk is not a slab */
    uint8_t listed;       /* on the class's partial list */
    uint8_t reserved[2];
} kva_slab;

typedef struct kva_size_class {
    /* The allocation fast path reads only the first cache line. */
    uint64_t *cur_l0;       /* the claimed l0 word, or &kva_slabs.no_word */
    uint64_t cur_offset;    /* pool offset of the claimed word's first object */
    uint32_t size;
    uint32_t cur_slab;      /* the slab holding the claimed word, or KVA_NIL */
    uint32_t nobj;          /* objects per slab */
    uint32_t cur_word;      /* index of the claimed word in its slab's l0 */
    uint64_t allocs;        /* objects handed out since creation */
    uint64_t frees;         /* objects returned since creation */
    uint64_t recip;         /* reciprocal of size, see KVA_RECIP_SHIFT */
    uint32_t l1_words;      /* l1 comes first in a slab's bitmap slot, l0 after it */
    uint32_t l0_words;
    uint32_t partial_head;  /* slabs with a free object; claims come from the head */
    uint32_t partial_tail;
    uint32_t empty_slab;    /* the empty slab kept as a spare, or KVA_NIL (see S4) */
    uint32_t slabs;
} kva_size_class;

typedef struct kva_slabs {
    kva_slab *slabs;        /* one descriptor per chunk of the pool (a partial tail chunk too) */
    uint64_t *bitmaps;      /* slot_words words per chunk, committed lazily by the kernel */
    size_t slot_words;
    uint32_t nchunks;       /* descriptors */
    unsigned chunk_shift;
    uint64_t chunk_mask;    /* chunk size - 1 */
    unsigned chunk_order;   /* the buddy order of one chunk */
    uint32_t live_slabs;
    size_t slabs_bytes, bitmaps_bytes;
    uint64_t no_word;       /* always 0: the current word of a class that has none */
    kva_size_class classes[KVA_NUM_SIZE_CLASSES];
    kva_region *region;     /* the pool's memory: a slab's chunk is committed when the slab is
                               made and decommitted when it is released (region.h) */
} kva_slabs;

kva_status kva_slabs_init(kva_slabs *sl, const kva_buddy *buddy, size_t capacity, unsigned chunk_shift);
void kva_slabs_fini(kva_slabs *sl);

/* The slow allocation path: claims a new current word for class c (growing a slab if needed),
 * then allocates from it. 0 if the buddy has no chunk left for a new slab. */
KVA_NOINLINE int kva_slab_alloc_slow(kva_slabs *sl, kva_buddy *buddy, unsigned c, uint64_t *offset);
/* The complete free of an object at pool offset `offset` inside slab chunk s: validates, frees,
 * and keeps the lists right. KVA_ERR_BAD_POINTER or KVA_ERR_DOUBLE_FREE change nothing. */
KVA_NOINLINE kva_status kva_slab_free_slow(kva_slabs *sl, kva_buddy *buddy, uint64_t offset);
/* Returns every empty slab to the buddy. */
void kva_slab_trim(kva_slabs *sl, kva_buddy *buddy);

KVA_INLINE uint64_t *kva_slab_bitmap(const kva_slabs *sl, uint32_t s) {
    return sl->bitmaps + (size_t)s * sl->slot_words;
}

KVA_INLINE uint32_t kva_slab_chunk(const kva_slabs *sl, uint64_t offset) {
    return (uint32_t)(offset >> sl->chunk_shift);
}

/* Where an object lives: found from its pool offset. */
typedef struct kva_object_ref {
    uint32_t slab;
    kva_size_class *cls;
    uint64_t *l0;   /* its l0 word */
    uint64_t bit;   /* its bit in that word */
} kva_object_ref;

/* Finds the object that starts at pool offset `offset`, which lies in slab chunk ref->slab (the
 * caller checked the chunk is a slab). 0 if the offset is not an object's first byte. */
KVA_INLINE int kva_slab_locate(const kva_slabs *sl, uint64_t offset, kva_object_ref *ref) {
    uint32_t s = kva_slab_chunk(sl, offset);
    kva_size_class *cls = (kva_size_class *)&sl->classes[sl->slabs[s].cls];
    uint64_t rel = offset & sl->chunk_mask;
    uint64_t object = (rel * cls->recip) >> KVA_RECIP_SHIFT;
    if (kva_unlikely(object * cls->size != rel || object >= cls->nobj)) return 0;
    ref->slab = s;
    ref->cls = cls;
    ref->l0 = sl->slabs[s].l0 + (object >> 6);
    ref->bit = (uint64_t)1 << (object & 63);
    return 1;
}

KVA_INLINE int kva_slab_is_live(const kva_object_ref *ref) { return !(*ref->l0 & ref->bit); }

/* Marks a located, live object free in the bitmaps; the caller fixes inuse and the lists. */
KVA_INLINE void kva_slab_mark_free(kva_slabs *sl, const kva_object_ref *ref) {
    uint64_t w0 = *ref->l0;
    *ref->l0 = w0 | ref->bit;
    if (kva_unlikely(w0 == 0) && ref->l0 != ref->cls->cur_l0) {
        /* The word has a free object again and is nobody's current word: list it. */
        uint64_t *slot = kva_slab_bitmap(sl, ref->slab);
        uint64_t word = (uint64_t)(ref->l0 - sl->slabs[ref->slab].l0);
        slot[word >> 6] |= (uint64_t)1 << (word & 63);
        sl->slabs[ref->slab].l2 |= (uint64_t)1 << (word >> 6);
    }
    ref->cls->frees++;
}

/* The allocation fast path: pops the lowest free object of class c's current word. 0 when that
 * word is exhausted (the caller then takes kva_slab_alloc_slow). About 15 instructions. */
KVA_INLINE int kva_slab_alloc_fast(kva_slabs *sl, unsigned c, uint64_t *offset) {
    kva_size_class *cls = &sl->classes[c];
    uint64_t bits = *cls->cur_l0;
    if (kva_unlikely(bits == 0)) return 0;
    *cls->cur_l0 = bits & (bits - 1);
    cls->allocs++;
    *offset = cls->cur_offset + (uint64_t)kva_ctz64(bits) * cls->size;
    return 1;
}

/* The free fast path for a pool offset known to lie inside the pool: 1 if it freed a live slab
 * object without a list transition; 0, with nothing changed, in every other case (not a slab, a
 * bad pointer, a double free, a slab that was full or becomes empty), for the slow path. */
KVA_INLINE int kva_slab_free_fast(kva_slabs *sl, uint64_t offset) {
    kva_slab *slab = &sl->slabs[kva_slab_chunk(sl, offset)];
    if (kva_unlikely(slab->cls == KVA_SLAB_NONE)) return 0;
    kva_object_ref ref;
    if (kva_unlikely(!kva_slab_locate(sl, offset, &ref) || !kva_slab_is_live(&ref))) return 0;
    if (ref.l0 == ref.cls->cur_l0) {
        /* Back into the current word: its slab already counts it as in use. */
        *ref.l0 |= ref.bit;
        ref.cls->frees++;
        return 1;
    }
    /* Fast only while inuse stays within [1, nobj - 1] before and after: 2 <= inuse < nobj. */
    uint32_t inuse = slab->inuse;
    if (kva_unlikely(inuse - 2 >= ref.cls->nobj - 2)) return 0;
    kva_slab_mark_free(sl, &ref);
    slab->inuse = inuse - 1;
    return 1;
}

#endif
