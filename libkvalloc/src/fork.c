/*
 * fork.c — a fork while other threads use pools. Only the forking thread lives on in the child,
 * so a lock another thread held at that moment would stay held forever. Around fork
 * (pthread_atfork) the forking thread takes every lock of every pool, in the library's lock
 * order (arena.h), so the child starts with every lock free and the locked metadata consistent.
 *
 * The other threads' caches stay as they were, owned by threads the child does not have: their
 * words (per class and thread at most a class's word limit, tcache.h) are lost to the child.
 * Giving them back would be wrong: a thread may have been halfway through a lock-free step (a
 * fast path between its bitmap store and its counter, a dry word given back but still listed),
 * and the child cannot tell; releasing those words corrupts slab counts (test_fork under TSan,
 * which slows the fast paths enough for a fork to land inside them, shows it). Left alone, they
 * keep every locked invariant, and kva_check skips the per-thread ones while those caches exist.
 *
 * A lock held across a driver call (loading the CUDA driver, importing a shared allocation) is
 * taken too: the fork waits for that call, as it waits for any other holder.
 *
 * Not covered: a KV cache's or a VarPool's own lock held by another thread's call at the moment
 * of the fork (the child must not use that cache or VarPool).
 */
#include <pthread.h>

#include "cuda_driver.h"
#include "lock.h"
#include "os.h"
#include "pool.h"
#include "publish.h"
#include "segment.h"
#include "var_pool.h"

/* The live pools' list (pool.h) is first in the lock order, then each named pool's publisher. */
static void prepare(void) {
    kva_pools_lock();
    for (kva_pool *p = kva_pools_first(); p; p = p->live_next) {
        kva_publisher *pub = kva_publisher_of(p);
        if (pub) pthread_mutex_lock(&pub->lock);
    }
    kva_tc_registry_lock();
    for (kva_pool *p = kva_pools_first(); p; p = p->live_next) {
        for (unsigned a = 0; a < p->slabs.narenas; a++) pthread_mutex_lock(&p->slabs.arenas[a].lock);
        pthread_mutex_lock(&p->lock);
    }
    kva_segments_lock(); /* leaves: nothing is taken under any of them */
    kva_vars_lock();
    kva_lock_flags_lock();
    kva_external_registry_lock();
    /* Held across driver calls (an import, a load); the import's lock before the load's, as an
     * import takes them. A fork waits for the call to end, and a child then finds both free. */
    kva_shared_imports_lock();
    kva_cuda_load_lock();
}

static void release_all(void) {
    kva_cuda_load_unlock();
    kva_shared_imports_unlock();
    kva_external_registry_unlock();
    kva_lock_flags_unlock();
    kva_vars_unlock();
    kva_segments_unlock();
    for (kva_pool *p = kva_pools_first(); p; p = p->live_next) {
        pthread_mutex_unlock(&p->lock);
        for (unsigned a = p->slabs.narenas; a-- > 0;) pthread_mutex_unlock(&p->slabs.arenas[a].lock);
    }
    kva_tc_registry_unlock();
    for (kva_pool *p = kva_pools_first(); p; p = p->live_next) {
        kva_publisher *pub = kva_publisher_of(p);
        if (pub) pthread_mutex_unlock(&pub->lock);
    }
}

static void parent(void) {
    release_all();
    kva_pools_unlock();
}

/* A pool whose memory is shared with other processes (kva_config.shared) is, in the child, a
 * copy of its owner's allocator over the owner's very bytes: what it handed out the owner hands
 * out too, and what it gave back (a free's discard, a trim) the owner reads as zeros. So the
 * child refuses every call that hands out or gives back its memory (inherited_shared, read by
 * the slow paths), and this thread lets go of its cache of the pool (kva_tc_forsake) as the
 * parent's other threads' caches are let go of: the fast paths then find no cache of the pool
 * in this process and take the slow paths. Private memory needs none of this: the child's copy
 * of it is its own (copy on write). A variable-size pool over shared memory is such a copy too,
 * found through its own list (kva_vars_forsake); a KV cache over it tells by its fork depth
 * (kv_lock_to_change). */
static void forsake_shared(void) {
    for (kva_pool *p = kva_pools_first(); p; p = p->live_next) {
        if (p->region.shared_fd < 0) continue;
        p->inherited_shared = 1;
        kva_tc_forsake(p);
    }
}

/* The child also lets go of the parent's statistics segments (kva_segment_disown): they
 * describe the parent's pools, are named after its pid and read by its inspectors. All of them,
 * those of pools another thread was creating or destroying at the fork included. */
static void child(void) {
    kva_os_fork_child();
    kva_segments_disown_all(); /* the list's lock is still held from prepare */
    forsake_shared();          /* every pool's locks and the registry's are held from prepare */
    kva_vars_forsake();        /* and the variable-size pools' list's */
    parent();
}

__attribute__((constructor)) static void install(void) { pthread_atfork(prepare, parent, child); }
