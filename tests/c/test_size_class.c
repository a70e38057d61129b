/*
 * test_size_class.c — the size-class table: range, spacing, the sizes the KV cache needs, and
 * that every request maps to the smallest class that holds it; the one-multiply division that
 * finds an object from its offset (kva_div_exact) against / and % for every class.
 */
#include "check.h"
#include "kvalloc.h"
#include "size_class.h"
#include "slab.h"

/* kva_div_exact agrees with / and % at offset d of a slab of objects of `size`. */
static int division_agrees(uint64_t d, uint64_t size, uint64_t magic) {
    uint64_t q;
    int exact = kva_div_exact(d, magic, &q);
    return q == d / size && exact == (d % size == 0);
}

/* Every offset of a 2 MiB slab (the default chunk), which covers every offset of a word (the
 * free window's range); then, up to the largest chunk (64 MiB), the offsets either side of
 * every object start and its middle, where a wrong quotient or exactness would show first. */
static void test_division(void) {
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        uint64_t size = kva_size_class_size(c), magic = kva_div_magic(size);
        unsigned wrong = 0;
        for (uint64_t d = 0; d < ((uint64_t)2 << 20); d++) wrong += !division_agrees(d, size, magic);
        for (uint64_t start = 0; start < ((uint64_t)64 << 20); start += size)
            wrong += !division_agrees(start, size, magic) + !division_agrees(start + 1, size, magic) +
                     !division_agrees(start + size / 2, size, magic) + !division_agrees(start + size - 1, size, magic);
        if (wrong)
            fprintf(stderr, "class %u (%llu B): %u offsets divided wrongly\n", c, (unsigned long long)size, wrong);
        CHECK(wrong == 0);
    }
}

int main(void) {
    CHECK(kva_size_class_size(0) == KVA_SLAB_MIN_SIZE);
    CHECK(kva_size_class_size(KVA_NUM_SIZE_CLASSES - 1) == KVA_SLAB_MAX_SIZE);
    CHECK(kva_size_class_size(KVA_NUM_SIZE_CLASSES) == 0);

    int has64 = 0, has4k = 0, has64k = 0;
    for (unsigned c = 0; c < KVA_NUM_SIZE_CLASSES; c++) {
        size_t size = kva_size_class_size(c);
        has64 |= size == 64;
        has4k |= size == 4096;
        has64k |= size == 65536;
        if (c > 0) {
            size_t prev = kva_size_class_size(c - 1);
            CHECK(size > prev);
            /* At most 25% apart: size <= 1.25 * prev. */
            CHECK(size * 4 <= prev * 5);
        }
        CHECK(size % 4 == 0);
    }
    CHECK(has64 && has4k && has64k);

    /* Every request size maps to the smallest class holding it. */
    unsigned expected = 0;
    for (size_t size = 1; size <= KVA_SLAB_MAX_SIZE; size++) {
        while (kva_size_class_size(expected) < size) expected++;
        if (kva_size_class_of(size) != (int)expected) {
            fprintf(stderr, "size %zu -> class %d, expected %u\n", size, kva_size_class_of(size), expected);
            check_failures++;
            break;
        }
    }
    /* The small-size table is the formula tabulated. */
    for (size_t size = 1; size <= KVA_CLASS_SMALL_LIMIT; size++)
        CHECK(kva_class_index(size) == kva_class_index_formula(size));
    /* And so is the table of the larger sizes, up to the largest class. */
    for (size_t size = KVA_CLASS_SMALL_LIMIT + 1; size <= KVA_SLAB_MAX_SIZE; size++)
        CHECK(kva_class_index(size) == kva_class_index_formula(size));
    CHECK(kva_size_class_of(0) == -1);
    CHECK(kva_size_class_of(KVA_SLAB_MAX_SIZE + 1) == -1);
    test_division();
    return CHECK_DONE();
}
