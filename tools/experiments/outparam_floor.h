/*
 * outparam_floor.h — the stand-ins of outparam_floor_lib.c, for outparam_floor.c.
 */
#ifndef KVA_OUTPARAM_FLOOR_H
#define KVA_OUTPARAM_FLOOR_H

#include <stddef.h>
#include <stdint.h>

#define FLOOR_BATCH 1000

typedef struct class_record {
    uint64_t *word;
    unsigned char *base;
    uint64_t size, allocs;
} class_record;

typedef struct thread_cache {
    const void *owner;
    class_record classes[8];
} thread_cache;

extern thread_cache floor_cache;  /* the one cache; its address is the "pool" */
extern unsigned floor_free_count; /* objects left in the array stand-ins' free array */

void floor_setup(void);
int floor_bitmap_out(const void *owner, size_t size, void **out);
void *floor_bitmap_return(const void *owner, size_t size);
int floor_array_out(const void *owner, size_t size, void **out);
void *floor_array_return(const void *owner, size_t size);

#endif
