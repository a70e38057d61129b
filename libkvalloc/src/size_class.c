/*
 * size_class.c — the public view of the size-class table.
 */
#include "size_class.h"

size_t kva_size_class_size(unsigned index) {
    return index < KVA_NUM_SIZE_CLASSES ? kva_class_size(index) : 0;
}

int kva_size_class_of(size_t size) {
    if (size == 0 || size > KVA_SLAB_MAX_SIZE) return -1;
    return (int)kva_class_index(size);
}
