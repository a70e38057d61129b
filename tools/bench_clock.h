/*
 * bench_clock.h — the clock and the medians the benchmark tools share: wall time in nanoseconds
 * from CLOCK_MONOTONIC, the median of repeated measurements, and a flush of the processor's
 * caches for measurements that start cold.
 */
#ifndef KVA_BENCH_CLOCK_H
#define KVA_BENCH_CLOCK_H

#include <stdlib.h>
#include <time.h>

static inline double bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of n values, sorted in place: the upper middle one for an even count. */
static inline double bench_median(double *values, size_t n)
{
    qsort(values, n, sizeof *values, bench_cmp_double);
    return values[n / 2];
}

/* The median of n sorted values, the mean of the two middle ones for an even count. */
static inline double bench_median_mean_sorted(const double *values, size_t n)
{
    return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

/* Evicts everything the processor caches hold, as a scheduler step's other work would: a 1 GiB
 * buffer (allocated once, kept) is written a cache line at a time. */
static inline void bench_flush_caches(void)
{
    static unsigned char *junk;
    static const size_t size = (size_t)1 << 30;
    if (!junk)
        junk = malloc(size);
    if (!junk)
        abort();
    for (size_t i = 0; i < size; i += 64)
        junk[i] = (unsigned char)(junk[i] + 1);
}

#endif
