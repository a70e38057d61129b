/*
 * cpu.h — which CPU a thread runs on, and which CPUs this process may run on (cpu.c): the facts
 * the slab layer's per-CPU arenas (arena.h) are chosen by.
 */
#ifndef KVA_CPU_H
#define KVA_CPU_H

#include "internal.h"

/* The CPU the calling thread runs on: the kernel's rseq area when libc registered one (a load),
 * sched_getcpu otherwise. Read only on slow paths; through the test hook when one is set. */
unsigned kva_cpu_current(void);

/* How many CPUs this process may run on (its affinity mask; the online CPUs if that cannot be
 * read), at least 1. */
unsigned kva_cpu_count(void);

/* The CPUs this process may run on (its affinity mask), in increasing order: up to max of them
 * into cpus; returns how many were written. */
unsigned kva_cpu_allowed(unsigned *cpus, unsigned max);

/* Test hook (process-wide; NULL functions restore the real CPU). fake_cpu(ctx), when set,
 * replaces the CPU id kva_cpu_current reads; after_read(ctx), when set, runs between reading the
 * CPU and locking that CPU's arena, the window in which a real migration would strike, so a
 * test can change the fake CPU there. */
void kva_cpu_test_hook(unsigned (*fake_cpu)(void *ctx), void (*after_read)(void *ctx), void *ctx);

/* Runs the after_read hook if one is set (called by the slow paths right after kva_cpu_current). */
void kva_cpu_after_read(void);

#endif
