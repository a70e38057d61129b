/*
 * outparam_floor_lib.c — the four allocation stand-ins outparam_floor.c measures, in a shared
 * library of their own so that they are reached the way bench_alloc reaches kva_alloc: through
 * the PLT, with the thread's cache found through an initial-exec thread-local variable. Not the
 * library: see outparam_floor.c.
 */
#include <stddef.h>
#include <stdint.h>

#include "outparam_floor.h"

static __thread thread_cache *current __attribute__((tls_model("initial-exec")));
thread_cache floor_cache;
static uint64_t bitmap_word;
static unsigned char arena[64 * 64];
static void *free_array[2 * FLOOR_BATCH];
unsigned floor_free_count;

/* The shared pop: 1 with *p set, 0 when the word is dry (refilled, and the caller retries). */
static inline int bitmap_pop(thread_cache *tc, size_t size, void **p) {
    class_record *k = &tc->classes[size >> 6 & 7];
    __asm__("" : "+r"(k));
    uint64_t bits = __atomic_load_n(k->word, __ATOMIC_RELAXED);
    if (bits == 0) {
        *k->word = ~(uint64_t)0;
        return 0;
    }
    __atomic_store_n(k->word, bits & (bits - 1), __ATOMIC_RELAXED);
    __asm__("addq $1, %0" : "+m"(k->allocs));
    *p = k->base + (uint64_t)__builtin_ctzll(bits) * k->size;
    return 1;
}

int floor_bitmap_out(const void *owner, size_t size, void **out) {
    thread_cache *tc = current;
    if (tc->owner != owner || out == NULL || size - 1 >= 1024) return 1;
    while (!bitmap_pop(tc, size, out)) {
    }
    return 0;
}

void *floor_bitmap_return(const void *owner, size_t size) {
    thread_cache *tc = current;
    void *p;
    if (tc->owner != owner || size - 1 >= 1024) return NULL;
    while (!bitmap_pop(tc, size, &p)) {
    }
    return p;
}

int floor_array_out(const void *owner, size_t size, void **out) {
    thread_cache *tc = current;
    if (tc->owner != owner || out == NULL || size - 1 >= 1024 || floor_free_count == 0) return 1;
    *out = free_array[--floor_free_count];
    return 0;
}

void *floor_array_return(const void *owner, size_t size) {
    thread_cache *tc = current;
    if (tc->owner != owner || size - 1 >= 1024 || floor_free_count == 0) return NULL;
    return free_array[--floor_free_count];
}

void floor_setup(void) {
    current = &floor_cache;
    floor_cache.owner = &floor_cache;
    for (int c = 0; c < 8; c++) floor_cache.classes[c] = (class_record){&bitmap_word, arena, 64, 0};
    for (unsigned i = 0; i < 2 * FLOOR_BATCH; i++) free_array[i] = arena + (i % 64) * 64;
}
