/*
 * bench_random.h — the random numbers the benchmark tools share: Marsaglia's xorshift64
 * (shifts 13, 7, 17; "Xorshift RNGs", Journal of Statistical Software 8(14), 2003). Every tool
 * seeds it with a fixed value, so a run's traces and keys are the same from run to run.
 */
#ifndef KVA_BENCH_RANDOM_H
#define KVA_BENCH_RANDOM_H

#include <stdint.h>

static inline uint64_t bench_xorshift64(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

#endif
