/*
 * cpu.c — which CPU a thread runs on, and which CPUs this process may run on.
 */
#include <sched.h>
#include <unistd.h>

#include "cpu.h"

#if defined(__has_include)
#if __has_include(<sys/rseq.h>)
#include <sys/rseq.h>
#define KVA_HAVE_RSEQ 1
#endif
#endif

static unsigned (*test_fake_cpu)(void *);
static void (*test_after_read)(void *);
static void *test_ctx;

void kva_cpu_test_hook(unsigned (*fake_cpu)(void *ctx), void (*after_read)(void *ctx), void *ctx) {
    __atomic_store_n(&test_ctx, ctx, __ATOMIC_SEQ_CST);
    __atomic_store_n(&test_after_read, after_read, __ATOMIC_SEQ_CST);
    __atomic_store_n(&test_fake_cpu, fake_cpu, __ATOMIC_SEQ_CST);
}

void kva_cpu_after_read(void) {
    void (*after)(void *) = __atomic_load_n(&test_after_read, __ATOMIC_ACQUIRE);
    if (kva_unlikely(after != NULL)) after(__atomic_load_n(&test_ctx, __ATOMIC_ACQUIRE));
}

unsigned kva_cpu_current(void) {
    unsigned (*fake)(void *) = __atomic_load_n(&test_fake_cpu, __ATOMIC_ACQUIRE);
    if (kva_unlikely(fake != NULL)) return fake(__atomic_load_n(&test_ctx, __ATOMIC_ACQUIRE));
#ifdef KVA_HAVE_RSEQ
    /* glibc 2.35+ registers an rseq area for every thread; the kernel keeps its cpu_id current
     * on every return to user space, so reading it is one load. */
    if (__rseq_size > 0) {
        const struct rseq *area = (const struct rseq *)((char *)__builtin_thread_pointer() + __rseq_offset);
        int32_t cpu = (int32_t)__atomic_load_n(&area->cpu_id, __ATOMIC_RELAXED);
        if (cpu >= 0) return (unsigned)cpu;
    }
#endif
    int cpu = sched_getcpu();
    return cpu >= 0 ? (unsigned)cpu : 0;
}

unsigned kva_cpu_allowed(unsigned *cpus, unsigned max) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
    unsigned n = 0;
    for (unsigned cpu = 0; cpu < CPU_SETSIZE && n < max; cpu++)
        if (CPU_ISSET(cpu, &set)) cpus[n++] = cpu;
    return n;
}

unsigned kva_cpu_count(void) {
    cpu_set_t set;
    long n = 0;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
    if (n <= 0) n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n <= 0) n = 1;
    return (unsigned)n;
}
