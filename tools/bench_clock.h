/*
 * bench_clock.h — the clock and the median the benchmark tools share: wall time in nanoseconds
 * from CLOCK_MONOTONIC, and the median of repeated measurements (sorted in place).
 */
#ifndef KVA_BENCH_CLOCK_H
#define KVA_BENCH_CLOCK_H

#include <stdlib.h>
#include <time.h>

static inline double bench_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline double bench_median(double *values, size_t n) {
    qsort(values, n, sizeof *values, bench_cmp_double);
    return values[n / 2];
}

#endif
