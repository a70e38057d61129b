/*
 * arena.h — per-CPU arenas: the slabs of a pool are spread over arenas, and a thread's slow
 * paths take words of free objects from the arena of the CPU it runs on.
 *
 * An arena holds, per size class, the partial list of its slabs and one spare empty slab, under
 * its own lock. A slab belongs to the arena that grew it for its whole life (kva_slab.arena), so
 * a word given back goes to the slab's arena whichever thread or CPU gives it. Nothing is lost
 * when a thread migrates between reading its CPU and locking that CPU's arena: the arena it
 * locks is merely a remote one for that call, which costs locality, never correctness.
 *
 * Lock order: the thread-cache registry, then arenas in index order (only kva_check, the stats
 * and publishing hold more than one), then the pool lock (buddy, region, block counters).
 */
#ifndef KVA_ARENA_H
#define KVA_ARENA_H

#include <pthread.h>

#include "internal.h"

/* One size class in one arena. */
typedef struct kva_arena_class {
    uint32_t partial_head;  /* slabs with a free object in a word nobody owns; claims come from
                               the head */
    uint32_t partial_tail;
    uint32_t empty_slab;    /* the empty slab kept as a spare, or KVA_NIL */
    uint32_t slabs;         /* slabs of this class in this arena */
} kva_arena_class;

typedef struct kva_arena {
    pthread_mutex_t lock;
    kva_arena_class classes[KVA_NUM_SIZE_CLASSES];
    uint64_t claims;        /* words handed to thread caches from this arena */
    /* The NUMA node whose memory the arena's slabs take (the node of its CPU), or -1. On a
     * machine with several nodes, a host pool without a numa_node of its own binds each new
     * slab's chunk to its arena's node (MPOL_PREFERRED: a full node lends memory rather than
     * fail) before the slab's memory is first touched; a chunk a slab of the same node had
     * before is not bound again. Pages touched before keep their node. */
    int node;
    uint32_t bind_failures; /* mbind refusals: the slab was made all the same */
} __attribute__((aligned(64))) kva_arena;

/* The CPU the calling thread runs on: the kernel's rseq area when libc registered one (a load),
 * sched_getcpu otherwise. Read only on slow paths; through the test hook when one is set. */
unsigned kva_arena_cpu(void);

/* The default arena count: the CPUs this process may run on, at most KVA_MAX_ARENAS. */
unsigned kva_arena_default_count(void);

/* The CPUs this process may run on (its affinity mask), in increasing order: up to max of them
 * into cpus; returns how many were written. */
unsigned kva_arena_allowed_cpus(unsigned *cpus, unsigned max);

/* Test hook (process-wide; NULL functions restore the real CPU). fake_cpu(ctx), when set,
 * replaces the CPU id a slow path reads; after_read(ctx), when set, runs between reading the
 * CPU and locking that CPU's arena, the window in which a real migration would strike, so a
 * test can change the fake CPU there. */
void kva_arena_test_hook(unsigned (*fake_cpu)(void *ctx), void (*after_read)(void *ctx), void *ctx);

/* Runs the after_read hook if one is set (called by the slow paths right after kva_arena_cpu). */
void kva_arena_after_read(void);

#endif
