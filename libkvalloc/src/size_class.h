/*
 * size_class.h — the slab size classes: 16 B, then four classes per power of two up to 64 KiB.
 *
 * Class 0 is 16 B. Above it, the classes in (2^k, 2^(k+1)] are 2^k + j * 2^(k-2) for j = 1..4,
 * so neighbours are at most 25% apart (20/16, 40/32, 80/64, ...) and every power of two from
 * 16 B to 64 KiB (64 B token metadata, 4 KiB pages, 64 KiB scratch) is a class of its own.
 * 49 classes in all. An object is aligned to the largest power of two dividing its class size
 * (the slab base is chunk-aligned), which is at least a quarter of the class's power of two.
 */
#ifndef KVA_SIZE_CLASS_H
#define KVA_SIZE_CLASS_H

#include "internal.h"

/* The class of a request of 1 .. KVA_SLAB_MAX_SIZE bytes by formula: the classes in
 * (2^k, 2^(k+1)] are 2^k + j * 2^(k-2), so a clz and a shift find it. */
KVA_INLINE unsigned kva_class_index_formula(size_t size) {
    if (size <= KVA_SLAB_MIN_SIZE) return 0;
    size_t s = size - 1;
    unsigned k = kva_log2(s);                  /* size lies in (2^k, 2^(k+1)] */
    unsigned j = (unsigned)(s >> (k - 2)) - 3; /* quarter of that range: 1..4 */
    return 1 + (k - 4) * 4 + (j - 1);
}

/* kva_class_small[(size + 3) / 4]: the class of a request of 1 .. 1,024 bytes, the sizes that
 * matter most. Every class up to 1 KiB is a multiple of 4, so a 4-byte granule decides it; the
 * table is the formula tabulated (test_size_class compares them for every size). */
#define KVA_CLASS_SMALL_LIMIT 1024
extern const uint8_t kva_class_small[KVA_CLASS_SMALL_LIMIT / 4 + 1];

/* kva_class_large[(size + 255) / 256]: the same for 1,025 .. KVA_SLAB_MAX_SIZE bytes (every
 * class above 1 KiB is a multiple of 256). */
extern const uint8_t kva_class_large[KVA_SLAB_MAX_SIZE / 256 + 1];

/* The class of a request of 1 .. KVA_SLAB_MAX_SIZE bytes: one table load. */
KVA_INLINE unsigned kva_class_index(size_t size) {
    if (kva_likely(size <= KVA_CLASS_SMALL_LIMIT)) return kva_class_small[(size + 3) >> 2];
    return kva_class_large[(size + 255) >> 8];
}

KVA_INLINE size_t kva_class_size(unsigned index) {
    if (index == 0) return KVA_SLAB_MIN_SIZE;
    unsigned k = 4 + (index - 1) / 4, j = (index - 1) % 4 + 1;
    return ((size_t)1 << k) + ((size_t)j << (k - 2));
}

#endif
