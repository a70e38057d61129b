/*
 * arena.h — per-CPU arenas, part of the slab layer: the slabs of a pool are spread over arenas,
 * and a thread's slow paths take words of free objects from the arena of the CPU it runs on
 * (cpu.h says which).
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

#include "cpu.h"
#include "internal.h"

/* One size class in one arena. */
typedef struct kva_arena_class {
    uint32_t partial_head; /* slabs with a free object in a word nobody owns; claims come from the head */
    uint32_t partial_tail;
    uint32_t empty_slab; /* the empty slab kept as a spare, or KVA_NIL */
    uint32_t slabs;      /* slabs of this class in this arena */
} kva_arena_class;

typedef struct kva_arena {
    pthread_mutex_t lock;
    kva_arena_class classes[KVA_NUM_SIZE_CLASSES];
    uint64_t claims; /* words handed to thread caches from this arena */
    /* The NUMA node whose memory the arena's slabs take (the node of its CPU), or -1. On a
     * machine with several nodes, a host pool without a numa_node of its own binds each new
     * slab's chunk to its arena's node (MPOL_PREFERRED: a full node lends memory rather than
     * fail) before the slab's memory is first touched; a chunk a slab of the same node had
     * before is not bound again. Pages touched before keep their node. */
    int node;
    uint32_t bind_failures; /* mbind refusals: the slab was made all the same */
} __attribute__((aligned(64))) kva_arena;

/* The default arena count: the CPUs this process may run on, at most KVA_MAX_ARENAS. */
static inline unsigned kva_arena_default_count(void) {
    unsigned n = kva_cpu_count();
    return n > KVA_MAX_ARENAS ? KVA_MAX_ARENAS : n;
}

#endif
