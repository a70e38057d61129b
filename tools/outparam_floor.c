/*
 * outparam_floor.c — what the shape of an allocation call costs in bench_alloc's 64 B batch,
 * apart from the allocator (docs/benchmarks.md, "What the numbers mean").
 *
 * It is not the library. Four stand-ins for a thread-cache allocation, in a shared library of
 * their own (outparam_floor_lib.c, called through the PLT as kva_alloc is) and driven the way
 * bench_alloc drives an allocator: a loop of 1,000 calls through a function pointer to a
 * wrapper that returns the pointer.
 *
 *   bitmap, out    kva_alloc's fast path: a thread-local cache, a 32-byte class record, pop
 *                  the lowest set bit of a bitmap word, count, write the pointer through `out`
 *   bitmap, return the same, returning the pointer in a register (malloc's shape)
 *   array, out     pop from an array of free pointers (no bitmap), through `out`
 *   array, return  the same, returning in a register
 *
 * The word holds 64 objects and is refilled (untimed work of a few instructions) when dry, as
 * a thread cache's current word is. If "bitmap, out" is well above "bitmap, return", the cost
 * is the out-pointer's, which kva_alloc's contract fixes, not the allocator's work.
 *
 * Usage: outparam_floor   (a Markdown table: ns per call, best of 7 runs of 20,000 batches)
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "bench_clock.h"
#include "outparam_floor.h"

#define BATCH FLOOR_BATCH
#define ROUNDS 20000
#define RUNS 7
#define OPAQUE __attribute__((noipa))

/* The wrappers bench_host.c has for each shape. */
OPAQUE static void *wrap_bitmap_out(size_t size) {
    void *p;
    return floor_bitmap_out(&floor_cache, size, &p) == 0 ? p : NULL;
}
OPAQUE static void *wrap_bitmap_return(size_t size) { return floor_bitmap_return(&floor_cache, size); }
OPAQUE static void *wrap_array_out(size_t size) {
    void *p;
    return floor_array_out(&floor_cache, size, &p) == 0 ? p : NULL;
}
OPAQUE static void *wrap_array_return(size_t size) { return floor_array_return(&floor_cache, size); }

static double measure(void *(*alloc)(size_t)) {
    static void *slots[BATCH];
    double best = 1e300;
    for (int run = 0; run < RUNS; run++) {
        double elapsed = 0;
        for (int r = 0; r < ROUNDS; r++) {
            floor_free_count = 2 * BATCH;
            double t0 = bench_now_ns();
            for (int i = 0; i < BATCH; i++) slots[i] = alloc(64);
            elapsed += bench_now_ns() - t0;
        }
        double ns = elapsed / ((double)ROUNDS * BATCH);
        if (ns < best) best = ns;
    }
    if (slots[BATCH - 1] == NULL) fprintf(stderr, "outparam_floor: an allocation failed\n");
    return best;
}

int main(void) {
    floor_setup();
    static const struct {
        const char *name;
        void *(*alloc)(size_t);
    } shapes[] = {{"bitmap, out", wrap_bitmap_out},
                  {"bitmap, return", wrap_bitmap_return},
                  {"array, out", wrap_array_out},
                  {"array, return", wrap_array_return}};
    printf("| call shape | ns per allocation |\n|---|---:|\n");
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        printf("| %s | %.2f |\n", shapes[i].name, measure(shapes[i].alloc));
    return 0;
}
