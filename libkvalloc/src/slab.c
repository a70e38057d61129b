/*
 * slab.c — slab creation, release and list upkeep: the slow paths behind slab.h.
 */
#include "os.h"
#include "slab.h"

static uint32_t words_for(uint64_t bits) { return (uint32_t)((bits + 63) / 64); }

kva_status kva_slabs_init(kva_slabs *sl, const kva_buddy *buddy, size_t capacity, unsigned chunk_shift) {
    *sl = (kva_slabs){.chunk_shift = chunk_shift, .chunk_order = chunk_shift - buddy->min_shift};
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

uint32_t kva_slab_grow(kva_slabs *sl, kva_buddy *buddy, unsigned c) {
    uint32_t head = kva_buddy_alloc(buddy, sl->chunk_order, KVA_BLOCK_SLAB);
    if (head == KVA_NIL) return KVA_NIL;
    uint32_t s = head >> sl->chunk_order;
    kva_size_class *cls = &sl->classes[c];
    kva_slab *slab = &sl->slabs[s];
    uint64_t *slot = kva_slab_bitmap(sl, s);
    fill_bits(slot + cls->l1_words, cls->nobj);
    fill_bits(slot, cls->l0_words);
    slab->l2 = cls->l1_words == 64 ? ~(uint64_t)0 : ((uint64_t)1 << cls->l1_words) - 1;
    slab->inuse = 0;
    slab->cls = (uint8_t)c;
    /* A fresh slab goes to the head: the class had no partial slab, so it is the only one. */
    slab->prev = KVA_NIL;
    slab->next = cls->partial_head;
    if (cls->partial_head != KVA_NIL) sl->slabs[cls->partial_head].prev = s;
    else cls->partial_tail = s;
    cls->partial_head = s;
    cls->slabs++;
    sl->live_slabs++;
    return s;
}

static void release(kva_slabs *sl, kva_buddy *buddy, uint32_t s) {
    kva_size_class *cls = &sl->classes[sl->slabs[s].cls];
    kva_partial_unlink(sl, cls, s);
    sl->slabs[s].cls = KVA_SLAB_NONE;
    cls->slabs--;
    sl->live_slabs--;
    kva_buddy_free(buddy, s << sl->chunk_order);
}

void kva_slab_settle(kva_slabs *sl, kva_buddy *buddy, uint32_t s) {
    kva_slab *slab = &sl->slabs[s];
    kva_size_class *cls = &sl->classes[slab->cls];
    if (slab->inuse + 1 == cls->nobj) {
        /* It was full, so on no list. The tail, not the head: allocation keeps filling the
         * slabs it is already in, and this one gets the chance to drain. */
        slab->next = KVA_NIL;
        slab->prev = cls->partial_tail;
        if (cls->partial_tail != KVA_NIL) sl->slabs[cls->partial_tail].next = s;
        else cls->partial_head = s;
        cls->partial_tail = s;
    }
    if (slab->inuse == 0) {
        /* Keep one empty slab per class so a batch that frees everything and allocates again
         * does not bounce a chunk through the buddy every round. */
        if (cls->empty_slab == KVA_NIL) cls->empty_slab = s;
        else release(sl, buddy, s);
    }
}

void kva_slab_trim(kva_slabs *sl, kva_buddy *buddy) {
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        kva_size_class *cls = &sl->classes[c];
        if (cls->empty_slab == KVA_NIL) continue;
        uint32_t s = cls->empty_slab;
        cls->empty_slab = KVA_NIL;
        release(sl, buddy, s);
    }
}
