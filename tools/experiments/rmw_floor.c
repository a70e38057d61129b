/*
 * rmw_floor.c — what a read-modify-write of one memory word costs when each one depends on the
 * last, in cycles of this processor (docs/benchmarks.md, "Why the two failing targets cannot be
 * met").
 *
 * It is not the library. A thread cache's bitmap word is loaded, changed and stored by every
 * allocation and free of its objects, and the next call loads it again: if that store-to-load
 * round trip took the usual 4-5 cycles, it would bound the 64 B batch whatever the instruction
 * count. This measures the round trip in three loops of 200 M iterations, x86-64 only:
 *
 *   clock            four dependent 64-bit imul per iteration (3 cycles each on every x86-64
 *                    core since Sandy Bridge), which gives the cycle time
 *   addq to memory   one `addq $1, (mem)` per iteration on the same word: a counter's bump
 *   load, or, store  the word loaded into a register, a bit or-ed in, stored back: a bitmap
 *                    word's free
 *
 * A processor that renames memory (forwards a store to the next load of the same address in
 * about one cycle) shows about 1 cycle for the last two; one that does not, 4-6.
 *
 * Usage: rmw_floor   (a Markdown table: ns per iteration and cycles, best of 5 runs)
 */
#include <stdint.h>
#include <stdio.h>

#include "bench_clock.h"

#define ITERATIONS 200000000L
#define RUNS 5

enum loop {
    CLOCK,
    ADD_TO_MEMORY,
    LOAD_OR_STORE
};

static double run(enum loop which) {
    uint64_t x = 3, word = 0, *address = &word;
    double t0 = bench_now_ns();
    for (long i = 0; i < ITERATIONS; i++) {
        if (which == CLOCK) {
            __asm__ volatile("imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0" : "+r"(x));
        } else if (which == ADD_TO_MEMORY) {
            __asm__ volatile("addq $1, (%0)" : : "r"(address) : "memory");
        } else {
            uint64_t bits;
            __asm__ volatile("mov (%1), %0\n\tor $1, %0\n\tmov %0, (%1)" : "=&r"(bits) : "r"(address) : "memory");
        }
    }
    return (bench_now_ns() - t0) / (double)ITERATIONS;
}

static double best(enum loop which) {
    double fastest = 1e300;
    for (int r = 0; r < RUNS; r++) {
        double ns = run(which);
        if (ns < fastest) fastest = ns;
    }
    return fastest;
}

int main(void) {
    double cycle = best(CLOCK) / 12.0; /* four imul of 3 cycles */
    double add = best(ADD_TO_MEMORY), load_or_store = best(LOAD_OR_STORE);
    printf("| loop | ns per iteration | cycles |\n|---|---:|---:|\n");
    printf("| clock: 4 dependent imul | %.3f | 12 (%.2f GHz) |\n", cycle * 12.0, 1.0 / cycle);
    printf("| addq $1 to one word | %.3f | %.1f |\n", add, add / cycle);
    printf("| load, or, store of one word | %.3f | %.1f |\n", load_or_store, load_or_store / cycle);
    return 0;
}
