/*
 * slab.c — slab creation, release and list upkeep: the slow paths behind slab.h.
 */
#include "os.h"
#include "slab.h"

static uint32_t words_for(uint64_t bits) { return (uint32_t)((bits + 63) / 64); }

/* The class has no current word: its fast path then sees a zero word and takes the slow path. */
static void forget_claim(kva_slabs *sl, kva_size_class *cls) {
    cls->cur_slab = KVA_NIL;
    cls->cur_l0 = &sl->no_word;
}

kva_status kva_slabs_init(kva_slabs *sl, const kva_buddy *buddy, size_t capacity, unsigned chunk_shift) {
    *sl = (kva_slabs){.chunk_shift = chunk_shift,
                      .chunk_mask = ((uint64_t)1 << chunk_shift) - 1,
                      .chunk_order = chunk_shift - buddy->min_shift};
    sl->nchunks = (uint32_t)((capacity + ((size_t)1 << chunk_shift) - 1) >> chunk_shift);
    size_t chunk = (size_t)1 << chunk_shift;
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        kva_size_class *cls = &sl->classes[c];
        cls->size = (uint32_t)kva_class_size(c);
        uint64_t nobj = chunk / cls->size;
        cls->nobj = (uint32_t)(nobj < KVA_SLAB_MAX_OBJECTS ? nobj : KVA_SLAB_MAX_OBJECTS);
        cls->recip = ((uint64_t)1 << KVA_RECIP_SHIFT) / cls->size + 1;
        cls->l0_words = words_for(cls->nobj);
        cls->l1_words = words_for(cls->l0_words);
        cls->partial_head = cls->partial_tail = cls->empty_slab = KVA_NIL;
        forget_claim(sl, cls);
        size_t words = (size_t)cls->l0_words + cls->l1_words;
        if (words > sl->slot_words) sl->slot_words = words;
    }
    sl->slabs_bytes = (size_t)sl->nchunks * sizeof(kva_slab);
    sl->bitmaps_bytes = (size_t)sl->nchunks * sl->slot_words * sizeof(uint64_t);
    void *slabs, *bitmaps;
    kva_status st = kva_os_map_metadata(sl->slabs_bytes, &slabs);
    if (st != KVA_OK) return st;
    st = kva_os_map_metadata(sl->bitmaps_bytes, &bitmaps);
    if (st != KVA_OK) {
        kva_os_unmap(slabs, sl->slabs_bytes);
        return st;
    }
    sl->slabs = slabs;
    sl->bitmaps = bitmaps;
    for (uint32_t s = 0; s < sl->nchunks; s++) sl->slabs[s].cls = KVA_SLAB_NONE;
    return KVA_OK;
}

void kva_slabs_fini(kva_slabs *sl) {
    kva_os_unmap(sl->slabs, sl->slabs_bytes);
    kva_os_unmap(sl->bitmaps, sl->bitmaps_bytes);
    sl->slabs = NULL;
    sl->bitmaps = NULL;
}

/* Sets the low n bits of every word in words[0 .. ceil(n/64)) and clears the rest. */
static void fill_bits(uint64_t *words, uint64_t n) {
    uint32_t full = (uint32_t)(n / 64);
    for (uint32_t w = 0; w < full; w++) words[w] = ~(uint64_t)0;
    if (n % 64) words[full] = ((uint64_t)1 << (n % 64)) - 1;
}

/* The class's partial list, doubly linked through the slab descriptors. A new slab goes to the
 * head, where claims come from. */
static void list_push_head(kva_slabs *sl, kva_size_class *cls, uint32_t s) {
    kva_slab *slab = &sl->slabs[s];
    slab->prev = KVA_NIL;
    slab->next = cls->partial_head;
    if (cls->partial_head != KVA_NIL) sl->slabs[cls->partial_head].prev = s;
    else cls->partial_tail = s;
    cls->partial_head = s;
    slab->listed = 1;
}

static void list_push_tail(kva_slabs *sl, kva_size_class *cls, uint32_t s) {
    kva_slab *slab = &sl->slabs[s];
    slab->next = KVA_NIL;
    slab->prev = cls->partial_tail;
    if (cls->partial_tail != KVA_NIL) sl->slabs[cls->partial_tail].next = s;
    else cls->partial_head = s;
    cls->partial_tail = s;
    slab->listed = 1;
}

static void list_unlink(kva_slabs *sl, kva_size_class *cls, uint32_t s) {
    kva_slab *slab = &sl->slabs[s];
    if (slab->prev != KVA_NIL) sl->slabs[slab->prev].next = slab->next;
    else cls->partial_head = slab->next;
    if (slab->next != KVA_NIL) sl->slabs[slab->next].prev = slab->prev;
    else cls->partial_tail = slab->prev;
    slab->listed = 0;
}

/* A new slab for class c at the head of its partial list; KVA_NIL if the buddy has no chunk or
 * no memory can back it (the pool then tries a buddy block, which reports why if it fails). */
static uint32_t grow(kva_slabs *sl, kva_buddy *buddy, unsigned c) {
    uint32_t head = kva_buddy_alloc(buddy, sl->chunk_order, KVA_BLOCK_SLAB);
    if (head == KVA_NIL) {
        /* Other classes' empty spares are free memory the buddy cannot see: give them back and
         * ask again, so this class gets a slab rather than the pool a whole block per object. */
        uint32_t before = sl->live_slabs;
        kva_slab_trim(sl, buddy);
        if (sl->live_slabs == before) return KVA_NIL;
        head = kva_buddy_alloc(buddy, sl->chunk_order, KVA_BLOCK_SLAB);
        if (head == KVA_NIL) return KVA_NIL;
    }
    uint32_t s = head >> sl->chunk_order;
    uint64_t offset = (uint64_t)s << sl->chunk_shift;
    if (kva_unlikely(kva_region_commit(sl->region, offset, sl->chunk_mask + 1) != KVA_OK)) {
        kva_buddy_free(buddy, head);
        return KVA_NIL;
    }
    kva_size_class *cls = &sl->classes[c];
    kva_slab *slab = &sl->slabs[s];
    uint64_t *slot = kva_slab_bitmap(sl, s);
    fill_bits(slot + cls->l1_words, cls->nobj);
    fill_bits(slot, cls->l0_words);
    slab->l2 = cls->l1_words == 64 ? ~(uint64_t)0 : ((uint64_t)1 << cls->l1_words) - 1;
    slab->l0 = slot + cls->l1_words;
    slab->inuse = 0;
    slab->cls = (uint8_t)c;
    list_push_head(sl, cls, s);
    cls->slabs++;
    sl->live_slabs++;
    return s;
}

static void release(kva_slabs *sl, kva_buddy *buddy, uint32_t s);

/* Slab s of class cls has just become empty. Keep one empty slab per class so that a batch that
 * frees everything and allocates again does not bounce a chunk through the buddy every round;
 * the spare named may have filled up since, and then s becomes the spare instead. */
static void emptied(kva_slabs *sl, kva_buddy *buddy, kva_size_class *cls, uint32_t s) {
    uint32_t spare = cls->empty_slab;
    if (spare != KVA_NIL && spare != s && sl->slabs[spare].inuse == 0) release(sl, buddy, s);
    else cls->empty_slab = s;
}

/* Gives up the class's current word: its free objects stop counting as in use, and if it has
 * any, l1 and l2 list it again. */
static void unclaim(kva_slabs *sl, kva_buddy *buddy, kva_size_class *cls) {
    uint32_t s = cls->cur_slab;
    if (s == KVA_NIL) return;
    uint64_t bits = *cls->cur_l0;
    kva_slab *slab = &sl->slabs[s];
    forget_claim(sl, cls);
    if (bits == 0) return;
    uint64_t *slot = kva_slab_bitmap(sl, s);
    slot[cls->cur_word >> 6] |= (uint64_t)1 << (cls->cur_word & 63);
    slab->l2 |= (uint64_t)1 << (cls->cur_word >> 6);
    slab->inuse -= (uint32_t)__builtin_popcountll(bits);
    if (!slab->listed) list_push_tail(sl, cls, s);
    if (slab->inuse == 0) emptied(sl, buddy, cls, s);
}

/* Claims a word with a free object for class c from the first listed slab that has one. Full
 * slabs met at the head leave the list here, once each, so the fast path never unlinks. */
static int claim(kva_slabs *sl, kva_buddy *buddy, unsigned c) {
    kva_size_class *cls = &sl->classes[c];
    unclaim(sl, buddy, cls);
    uint32_t s;
    for (;;) {
        s = cls->partial_head;
        if (s == KVA_NIL) {
            s = grow(sl, buddy, c);
            if (s == KVA_NIL) return 0;
        }
        if (sl->slabs[s].l2 != 0) break;
        list_unlink(sl, cls, s); /* full: with no word claimed, every free object is listed */
    }
    kva_slab *slab = &sl->slabs[s];
    uint64_t *slot = kva_slab_bitmap(sl, s);
    unsigned i = kva_ctz64(slab->l2);
    uint64_t w1 = slot[i];
    uint32_t word = i * 64 + kva_ctz64(w1);
    slot[i] = w1 &= w1 - 1;
    if (w1 == 0) slab->l2 &= slab->l2 - 1;
    cls->cur_slab = s;
    cls->cur_word = word;
    cls->cur_l0 = slab->l0 + word;
    slab->inuse += (uint32_t)__builtin_popcountll(*cls->cur_l0);
    cls->cur_offset = ((uint64_t)s << sl->chunk_shift) + (uint64_t)word * 64 * cls->size;
    return 1;
}

int kva_slab_alloc_slow(kva_slabs *sl, kva_buddy *buddy, unsigned c, uint64_t *offset) {
    if (!kva_slab_alloc_fast(sl, c, offset)) {
        if (!claim(sl, buddy, c)) return 0;
        kva_slab_alloc_fast(sl, c, offset); /* cannot fail: the claimed word has a free object */
    }
    return 1;
}

static void release(kva_slabs *sl, kva_buddy *buddy, uint32_t s) {
    kva_size_class *cls = &sl->classes[sl->slabs[s].cls];
    if (cls->cur_slab == s) forget_claim(sl, cls);
    if (sl->slabs[s].listed) list_unlink(sl, cls, s);
    sl->slabs[s].cls = KVA_SLAB_NONE;
    cls->slabs--;
    sl->live_slabs--;
    kva_region_decommit(sl->region, (uint64_t)s << sl->chunk_shift, sl->chunk_mask + 1);
    kva_buddy_free(buddy, s << sl->chunk_order);
}

kva_status kva_slab_free_slow(kva_slabs *sl, kva_buddy *buddy, uint64_t offset) {
    kva_object_ref ref;
    if (!kva_slab_locate(sl, offset, &ref)) return KVA_ERR_BAD_POINTER;
    if (!kva_slab_is_live(&ref)) return KVA_ERR_DOUBLE_FREE;
    kva_size_class *cls = ref.cls;
    if (ref.l0 == cls->cur_l0) {
        *ref.l0 |= ref.bit; /* back into the current word, which its slab counts as in use */
        cls->frees++;
        return KVA_OK;
    }
    kva_slab_mark_free(sl, &ref);
    kva_slab *slab = &sl->slabs[ref.slab];
    slab->inuse--;
    /* It had no free object, so it may have left the list. The tail, not the head: allocation
     * keeps filling the slabs it is in, and this one gets the chance to drain. */
    if (!slab->listed) list_push_tail(sl, cls, ref.slab);
    if (slab->inuse == 0) emptied(sl, buddy, cls, ref.slab);
    return KVA_OK;
}

void kva_slab_trim(kva_slabs *sl, kva_buddy *buddy) {
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        kva_size_class *cls = &sl->classes[c];
        /* A claimed word keeps its slab counted as in use: give it up first. */
        unclaim(sl, buddy, cls);
        uint32_t spare = cls->empty_slab;
        cls->empty_slab = KVA_NIL;
        if (spare != KVA_NIL && sl->slabs[spare].inuse == 0) release(sl, buddy, spare);
    }
}
