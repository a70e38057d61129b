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
 * Invariants (kva_check verifies each):
 *  S1  slabs[c].cls != KVA_SLAB_NONE iff the buddy block at chunk c is a SLAB head of chunk order.
 *  S2  popcount(l0) == nobj - inuse; no bit at or beyond nobj is set; every l1 and l2 bit is set
 *      iff the word below it is nonzero.
 *  S3  A slab is on its class's partial list iff inuse < nobj; the list is doubly linked.
 *  S4  At most one slab per class is empty (inuse == 0), and it is that class's empty_slab.
 *  S5  A class's live count equals the sum of inuse over its slabs, and slabs its slab count.
 */
#ifndef KVA_SLAB_H
#define KVA_SLAB_H

#include "buddy.h"
#include "size_class.h"

#define KVA_SLAB_NONE 0xffu
#define KVA_SLAB_MAX_OBJECTS (1u << 18)
/* Object index = (offset in slab * recip) >> KVA_RECIP_SHIFT, exact for offsets below 2^26 and
 * sizes up to 2^16 (offset * size < 2^42), and the product stays below 2^64. */
#define KVA_RECIP_SHIFT 42

typedef struct kva_slab {
    uint64_t l2;          /* bit i: l1 word i is nonzero */
    uint32_t prev, next;  /* links of the class's partial list */
    uint32_t inuse;       /* live objects */
    uint8_t cls;          /* size class, or KVA_SLAB_NONE if the chunk is not a slab */
    uint8_t reserved[3];
} kva_slab;

typedef struct kva_size_class {
    uint32_t size;
    uint32_t nobj;          /* objects per slab */
    uint64_t recip;         /* ceil-ish reciprocal of size, see KVA_RECIP_SHIFT */
    uint32_t l1_words;      /* l1 comes first in a slab's bitmap slot, l0 after it */
    uint32_t l0_words;
    uint32_t partial_head;  /* slabs with a free object; the head is where allocation goes */
    uint32_t partial_tail;
    uint32_t empty_slab;    /* the one empty slab kept as a spare, or KVA_NIL */
    uint32_t slabs;
    uint64_t live;          /* live objects in this class */
} kva_size_class;

typedef struct kva_slabs {
    kva_slab *slabs;        /* one descriptor per chunk of the pool (a partial tail chunk too) */
    uint64_t *bitmaps;      /* slot_words words per chunk, committed lazily by the kernel */
    size_t slot_words;
    uint32_t nchunks;       /* descriptors */
    unsigned chunk_shift;
    unsigned chunk_order;   /* the buddy order of one chunk */
    uint32_t live_slabs;
    size_t slabs_bytes, bitmaps_bytes;
    kva_size_class classes[KVA_NUM_SIZE_CLASSES];
} kva_slabs;

kva_status kva_slabs_init(kva_slabs *sl, const kva_buddy *buddy, size_t capacity, unsigned chunk_shift);
void kva_slabs_fini(kva_slabs *sl);

/* Slow paths, out of line. grow: a new slab for class c (KVA_NIL if the buddy is exhausted).
 * settle: after a free made slab s partial or empty, fix its list membership. */
KVA_NOINLINE uint32_t kva_slab_grow(kva_slabs *sl, kva_buddy *buddy, unsigned c);
KVA_NOINLINE void kva_slab_settle(kva_slabs *sl, kva_buddy *buddy, uint32_t s);
/* Returns every empty slab to the buddy. */
void kva_slab_trim(kva_slabs *sl, kva_buddy *buddy);

KVA_INLINE uint64_t *kva_slab_bitmap(const kva_slabs *sl, uint32_t s) {
    return sl->bitmaps + (size_t)s * sl->slot_words;
}

KVA_INLINE void kva_partial_unlink(kva_slabs *sl, kva_size_class *cls, uint32_t s) {
    kva_slab *slab = &sl->slabs[s];
    if (slab->prev != KVA_NIL) sl->slabs[slab->prev].next = slab->next;
    else cls->partial_head = slab->next;
    if (slab->next != KVA_NIL) sl->slabs[slab->next].prev = slab->prev;
    else cls->partial_tail = slab->prev;
}

/* Takes one object of class c; its offset from the pool base goes to *offset. Returns 0 when the
 * buddy has no chunk left. About 30 instructions when the class has a partial slab. */
KVA_INLINE int kva_slab_alloc(kva_slabs *sl, kva_buddy *buddy, unsigned c, uint64_t *offset) {
    kva_size_class *cls = &sl->classes[c];
    uint32_t s = cls->partial_head;
    if (kva_unlikely(s == KVA_NIL)) {
        s = kva_slab_grow(sl, buddy, c);
        if (s == KVA_NIL) return 0;
    }
    kva_slab *slab = &sl->slabs[s];
    uint64_t *slot = kva_slab_bitmap(sl, s);
    unsigned i = kva_ctz64(slab->l2);
    uint64_t w1 = slot[i];
    unsigned word = i * 64 + kva_ctz64(w1);
    uint64_t *l0 = slot + cls->l1_words + word;
    uint64_t w0 = *l0;
    unsigned object = word * 64 + kva_ctz64(w0);
    *l0 = w0 &= w0 - 1;
    if (w0 == 0) {
        slot[i] = w1 &= w1 - 1; /* the lowest set bit of w1 is this word's */
        if (w1 == 0) slab->l2 &= slab->l2 - 1;
    }
    if (s == cls->empty_slab) cls->empty_slab = KVA_NIL;
    if (++slab->inuse == cls->nobj) kva_partial_unlink(sl, cls, s);
    cls->live++;
    *offset = ((uint64_t)s << sl->chunk_shift) + (uint64_t)object * cls->size;
    return 1;
}

/* The object index of byte rel of slab s, or -1 if rel is not an object's first byte. */
KVA_INLINE int64_t kva_slab_object(const kva_slabs *sl, uint32_t s, uint64_t rel) {
    const kva_size_class *cls = &sl->classes[sl->slabs[s].cls];
    uint64_t object = (rel * cls->recip) >> KVA_RECIP_SHIFT;
    if (kva_unlikely(object * cls->size != rel || object >= cls->nobj)) return -1;
    return (int64_t)object;
}

KVA_INLINE int kva_slab_is_live(const kva_slabs *sl, uint32_t s, uint64_t object) {
    const uint64_t *slot = kva_slab_bitmap(sl, s);
    uint32_t l1_words = sl->classes[sl->slabs[s].cls].l1_words;
    return !(slot[l1_words + (object >> 6)] >> (object & 63) & 1);
}

/* Frees byte rel of slab s (the caller found s from the address). KVA_ERR_BAD_POINTER if rel is
 * not an object's start, KVA_ERR_DOUBLE_FREE if that object is already free; nothing changes
 * then. */
KVA_INLINE kva_status kva_slab_free(kva_slabs *sl, kva_buddy *buddy, uint32_t s, uint64_t rel) {
    int64_t found = kva_slab_object(sl, s, rel);
    if (kva_unlikely(found < 0)) return KVA_ERR_BAD_POINTER;
    uint64_t object = (uint64_t)found;
    kva_slab *slab = &sl->slabs[s];
    kva_size_class *cls = &sl->classes[slab->cls];
    uint64_t *slot = kva_slab_bitmap(sl, s);
    uint64_t word = object >> 6, bit = (uint64_t)1 << (object & 63);
    uint64_t *l0 = slot + cls->l1_words + word;
    uint64_t w0 = *l0;
    if (kva_unlikely(w0 & bit)) return KVA_ERR_DOUBLE_FREE;
    *l0 = w0 | bit;
    if (w0 == 0) {
        slot[word >> 6] |= (uint64_t)1 << (word & 63);
        slab->l2 |= (uint64_t)1 << (word >> 6);
    }
    cls->live--;
    uint32_t before = slab->inuse--;
    if (kva_unlikely(before == cls->nobj || before == 1)) kva_slab_settle(sl, buddy, s);
    return KVA_OK;
}

#endif
