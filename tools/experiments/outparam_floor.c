/*
 * outparam_floor.c — what the shape of an allocation call costs in bench_alloc's 64 B batch,
 * apart from the allocator (docs/benchmarks.md, "Why the two failing targets cannot be met").
 *
 * It is not the library. Four stand-ins for a thread-cache allocation, in a shared library of
 * their own (outparam_floor_lib.c, reached as kva_alloc is: a function in another shared object,
 * its thread cache behind an initial-exec thread-local variable), each called in a loop of
 * 1,000 calls the way bench_alloc's batch calls an allocator: through a function pointer to the
 * entry point itself, in the entry point's own shape (the pointer through `out` into the slot,
 * or returned and stored by the caller).
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

typedef int (*out_shape)(const void *owner, size_t size, void **out);
typedef void *(*return_shape)(const void *owner, size_t size);

/* One shape's best run: exactly one of out and ret is set. */
static double measure(out_shape out, return_shape ret) {
    static void *slots[BATCH];
    const void *owner = &floor_cache;
    double best = 1e300;
    int failed = 0;
    for (int run = 0; run < RUNS; run++) {
        double elapsed = 0;
        for (int r = 0; r < ROUNDS; r++) {
            floor_free_count = 2 * BATCH;
            double t0 = bench_now_ns();
            if (out != NULL)
                for (int i = 0; i < BATCH; i++) failed |= out(owner, 64, &slots[i]);
            else
                for (int i = 0; i < BATCH; i++) failed |= (slots[i] = ret(owner, 64)) == NULL;
            elapsed += bench_now_ns() - t0;
        }
        double ns = elapsed / ((double)ROUNDS * BATCH);
        if (ns < best) best = ns;
    }
    if (failed) fprintf(stderr, "outparam_floor: an allocation failed\n");
    return best;
}

int main(void) {
    floor_setup();
    /* Through volatile pointers, so that the compiler calls each one as it would an allocator
     * chosen at run time. */
    out_shape volatile bitmap_out = floor_bitmap_out, array_out = floor_array_out;
    return_shape volatile bitmap_return = floor_bitmap_return, array_return = floor_array_return;
    printf("| call shape | ns per allocation |\n|---|---:|\n");
    printf("| bitmap, out | %.2f |\n", measure(bitmap_out, NULL));
    printf("| bitmap, return | %.2f |\n", measure(NULL, bitmap_return));
    printf("| array, out | %.2f |\n", measure(array_out, NULL));
    printf("| array, return | %.2f |\n", measure(NULL, array_return));
    return 0;
}
