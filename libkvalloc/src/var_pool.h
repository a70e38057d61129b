/*
 * var_pool.h — the variable-size pool (kva_var_*): ranges of any multiple of the alignment, with
 * the boundary tags out of band.
 *
 * Everything is counted in units of the alignment, as u32 unit indices. ranges[] has one record
 * per unit; only the record of a range's first unit (its head) is meaningful, every other one is
 * all zero. That makes "the range that starts here" one load, at 16 B of address space per
 * unit (6.25% at the default 256 B), committed lazily: the pages of records are only resident
 * where ranges start. Each head records the start of the range before it, so a free finds both
 * neighbours in O(1): the next one at start + length, the previous one at prev.
 * One more record, ranges[units], is a sentinel: length 0, so never free and never a head; its
 * prev names the last range, and the first range's prev names it. The heads and the sentinel
 * thus form a ring, and every range has two neighbours: the hot paths test a neighbour for
 * "free" and write a follower's prev without first asking whether the range touches an edge.
 *
 * The free ranges are kept in one structure chosen by the policy:
 *  FIRST_FIT  a doubly linked list in address order. A merge or a split keeps the list place of
 *             the range it changes; only a free with no free neighbour walks, back over the
 *             ranges before it to the nearest free one.
 *  BEST_FIT, WORST_FIT  a doubly linked list in nondecreasing length, equal lengths in address
 *             order (head and tail): best fit scans from the head, worst fit takes the tail.
 *             Insertion walks the list, so both are O(free ranges): simple and exact, meant as
 *             the baselines TLSF is compared to.
 *  TLSF       two-level segregated lists after Masmano, Ripoll, Crespo and Real, "TLSF: a New
 *             Dynamic Memory Allocator for Real-Time Systems" (ECRTS 2004): a first level by
 *             log2 of the length, a second by KVA_TLSF_SL linear subdivisions of it, one bitmap
 *             word per level; a request takes the head of its own class when that range holds
 *             it, else, rounded up to the next class boundary, the head of the first nonempty
 *             class at or above it (ctz on two words): O(1). A class's head is the lower-
 *             addressed of itself and each range added after it (tlsf_push).
 *
 * Placement. The structure picks the free range; which end of it a shorter request is carved
 * from is a choice of its own (kva_var_carve_high below):
 *  - First and worst fit: the low end. First fit's address order is its strength (packing
 *    toward the low end lets the top of the pool stay one free range; Shore, CACM 18(8), 1975),
 *    and the rule below would undo it: with it, first fit fragments bench_varpool's forward
 *    passes 10.2 % instead of 2.8 %, 35.8 % instead of 12.7 % in the tight pool.
 *  - Best fit and TLSF, for a request of at least KVA_VAR_CARVE_MIN units: the end beside the
 *    shorter of the range's two neighbours, a pool edge counting as shorter than any range, the
 *    low end on a tie; the remainder then lies beside the longer neighbour. Why: a remainder
 *    rejoins a large free range when a neighbour of it is freed, so it belongs beside the
 *    neighbour freed first, and an edge is never freed. Length stands in for the unknown free
 *    time: in an inference engine the long buffers (activations, logits) are the transient
 *    ones and the short ones (per-request state, small tensors) live long, the split behind
 *    PyTorch's CUDA caching allocator keeping blocks up to 1 MiB apart from larger ones so that
 *    small blocks do not pepper the space large ones need; size as a lifetime predictor is
 *    Barrett and Zorn's (PLDI 1993). On the forward passes in the tight pool best fit fragments
 *    18.6 % with the low end, 6.8 % with this rule, and 6.3 % when the same choice is made from
 *    the trace's actual free times (an oracle). Where length says nothing about lifetime (the
 *    random trace) the rule neither helps nor much hurts, and no choice of end brings best fit
 *    or TLSF down to first fit there, not even the oracle's (docs/benchmarks.md).
 *  - A request below KVA_VAR_CARVE_MIN units (8 KiB at 256 B) takes the low end: where it goes
 *    barely moves the figures (any minimum from 1 to 256 units gives the same within 0.6
 *    points), and leaving it out spares TLSF's path for small requests the placement test.
 *
 * Invariants (kva_var_check verifies each):
 *  V1  The heads tile [0, units): walking head -> head + length from 0 visits every range once
 *      and ends at units; every record between two heads is all zero; each head's prev is the
 *      previous head (the sentinel, units, for the first); the sentinel is all zero but its
 *      prev, which is the last head.
 *  V2  No two free ranges are adjacent: freeing merges with both neighbours.
 *  V3  Every free range is in the policy's structure exactly once, and nothing else is: the
 *      lists are doubly linked (next->link_prev == self), ordered as stated above, their tail
 *      (best and worst fit) is the last element, and they hold free_ranges elements.
 *  V4  TLSF: a range sits in the class its length maps to; bit sl of sl_map[fl] is set iff
 *      class (fl, sl) is not empty, and bit fl of fl_map iff sl_map[fl] is not zero. Under the
 *      other policies both maps stay zero (the TLSF fast path in kva_var_alloc relies on it
 *      instead of testing the policy).
 *  V5  free_units counts the units of free ranges, free_ranges the free ranges, and
 *      alloc_count - free_count the used ones; requested_bytes sums the used ranges' requested
 *      sizes, each of which rounds up to the range's length.
 *
 * Threads. One lock per pool (`lock`, lock.h: biased to the thread that keeps using it, else an
 * exchange to take it and a store to give it back) guards the ranges, the free structures and
 * the counters. Every public entry point but kva_var_base (which reads base, fixed at creation)
 * and kva_var_destroy (which must not overlap any other call) holds it for the whole call: a
 * public wrapper checks what the fields fixed at creation decide, then locks and runs a static
 * *_locked implementation. Alloc and free enter by the bias when they can, and then their
 * locked code releases the lock on every return path (kva_var_leave below, so that the slow
 * parts are tail calls); when they cannot, alloc_plain and free_plain take the plain lock, run
 * the same code (which then leaves the lock alone) and release it. Every other entry point
 * locks and unlocks around its *_locked call. The pool calls the backing kva_pool only at
 * create and destroy, never under its lock.
 *
 * Files. var_pool.c: kva_var_create, kva_var_destroy and the small queries (kva_var_base,
 * kva_var_usable_size). var_tlsf.c: TLSF's classes, and kva_var_alloc and kva_var_free, into
 * which TLSF's common paths are inlined. var_fit.c: first, best and worst fit, to which those two
 * hand the other policies' calls. var_reject.c: the calls that fail, counted and told why.
 * var_stats.c: kva_var_get_stats. var_check.c: kva_var_check.
 */
#ifndef KVA_VAR_POOL_H
#define KVA_VAR_POOL_H

#include "internal.h"
#include "lock.h"

#define KVA_VAR_FREE_BIT 0x80000000u /* in kva_var_range.length */
#define KVA_VAR_MAX_UNITS 0x7fffffffu

#define KVA_TLSF_SL_LOG2 5
#define KVA_TLSF_SL (1u << KVA_TLSF_SL_LOG2)
/* Lengths below KVA_TLSF_SL units share first level 0 (one class per length); a length with
 * log2 k >= KVA_TLSF_SL_LOG2 has first level k - KVA_TLSF_SL_LOG2 + 1, up to 30 - 4. */
#define KVA_TLSF_FL (31 - KVA_TLSF_SL_LOG2 + 1)

/* Best fit and TLSF carve a request of at least this many units (the lengths of TLSF's first
 * level above the one-length classes) at the end of its range that the placement rule picks
 * ("Placement" above); a shorter one at the low end. */
#define KVA_VAR_CARVE_MIN KVA_TLSF_SL

/* Records a bad free looks back over for the head of the range that holds it, before it asks
 * the free ranges instead (classify_bad_free in var_reject.c): the look back finds it beside
 * short ranges, and a long range must not hold the lock for a scan of its records (a free inside
 * a free pool of 2^28 units took 0.57 s). */
#define KVA_VAR_BACK_SCAN 4096u

typedef struct kva_var_range {
    uint32_t length; /* units, with KVA_VAR_FREE_BIT set while free; 0: not a head */
    /* the head of the previous range in address order; the sentinel's index (units) for the first
     * range */
    uint32_t prev;
    uint32_t link_prev; /* FREE: links in the policy's structure. USED: the requested size in */
    uint32_t link_next; /* bytes, low word in link_prev and high word in link_next */
} kva_var_range;

struct kva_var {
    kva_lock lock; /* guards everything below but the fields fixed at creation */
    /* Fixed at creation: ranges (the pointer), ranges_bytes, units, align_shift, bytes,
     * align_mask, alignment, policy, base, pool, owns_pool. */
    kva_var_range *ranges;
    size_t ranges_bytes;
    uint32_t units;       /* capacity / alignment */
    unsigned align_shift; /* log2(alignment) */
    uint64_t bytes;       /* units << align_shift, and alignment - 1: the hot paths' bounds */
    uint64_t align_mask;
    /* a unit's bytes, for the fast path's multiply (a shift by a count in a register ties up cl on
     * x86) */
    uint64_t alignment;
    kva_var_policy policy;
    char *base;
    kva_pool *pool; /* the backing pool */
    int owns_pool;  /* created by kva_var_create, destroyed with the variable-size pool */
    /* Over a pool whose memory other processes share (kva_pool_range_shared): listed process-wide
     * (shared_next), so that a forked child's copy can be found and stopped (kva_vars_forsake) */
    int over_shared;
    /* This process is a child forked from the pool's creator and the memory is shared: bytes
     * is 0 (the fast paths' tests then send every call to the refusals, which say why) */
    int inherited;
    struct kva_var *shared_prev, *shared_next;

    uint32_t head, tail; /* FIRST, BEST, WORST: the free list */
    uint32_t fl_map;     /* TLSF */
    uint32_t sl_map[KVA_TLSF_FL];
    uint32_t bins[KVA_TLSF_FL * KVA_TLSF_SL]; /* class heads, by kva_tlsf_index */

    /* the used units and the live ranges are derived: units - free_units, alloc_count - free_count */
    uint64_t free_units;
    uint64_t low_free_units; /* the fewest free_units since creation or kva_var_reset_peaks */
    uint64_t free_ranges, requested_bytes;
    uint64_t alloc_count, free_count, alloc_failures, rejected_calls;
};

/* The process-wide list of variable-size pools over shared memory, for fork (fork.c): its lock,
 * a leaf taken around a fork, and in the child (one thread, the lock held), the forsaking of
 * each: the pool is a copy of the creator's over the creator's bytes, and from now on it hands
 * out and takes back nothing (KVA_ERR_BACKEND). */
void kva_vars_lock(void);
void kva_vars_unlock(void);
void kva_vars_forsake(void);
/* Why a call on a forsaken pool is refused. */
kva_status kva_var_refuse_inherited(void);

KVA_INLINE uint32_t kva_var_len(const kva_var_range *r) { return r->length & ~KVA_VAR_FREE_BIT; }
KVA_INLINE int kva_var_is_free(const kva_var_range *r) { return (r->length & KVA_VAR_FREE_BIT) != 0; }
KVA_INLINE uint64_t kva_var_requested(const kva_var_range *r) {
    return (uint64_t)r->link_prev | (uint64_t)r->link_next << 32;
}

/* The TLSF class of a free range of `length` units (length >= 1) as one index,
 * fl * KVA_TLSF_SL + sl, without a branch. s = max(log2 length, KVA_TLSF_SL_LOG2) -
 * KVA_TLSF_SL_LOG2 is how far length must shift to fall below 2 KVA_TLSF_SL. Below KVA_TLSF_SL
 * units s is 0 and the index is the length (first level 0, one class per length); above,
 * length >> s lies in [KVA_TLSF_SL, 2 KVA_TLSF_SL), and adding s levels puts it at first level
 * s + 1, second level the KVA_TLSF_SL_LOG2 bits below its top one. */
KVA_INLINE unsigned kva_tlsf_index(uint32_t length) {
    unsigned s = kva_log2(length | KVA_TLSF_SL) - KVA_TLSF_SL_LOG2;
    return (s << KVA_TLSF_SL_LOG2) + (length >> s);
}

/* The shortest length of each class, by class index: what tlsf_alloc's fast path loads instead of
 * shifting by a count in a register (which on x86 must pass through cl, costing a register and
 * the moves around it). */
extern const uint32_t kva_tlsf_floors[KVA_TLSF_FL * KVA_TLSF_SL];

KVA_INLINE void kva_tlsf_class(uint32_t length, unsigned *fl, unsigned *sl) {
    unsigned index = kva_tlsf_index(length);
    *fl = index >> KVA_TLSF_SL_LOG2;
    *sl = index & (KVA_TLSF_SL - 1);
}

/* ---- the range records, as every policy changes them --------------------------------------- */

/* The range after the one at `start` of `length` units (the sentinel after the last) names it as
 * prev. */
KVA_INLINE void kva_var_link_follower(kva_var *v, uint32_t start, uint32_t length) {
    v->ranges[start + length].prev = start;
}

/* Splits the free range at `at` of `length` units after its first `units`: the tail becomes a
 * free range of its own, linked both ways in address order, in no free structure yet. Returns
 * the tail. `ranges` is v->ranges, which a caller on the hot path already holds. */
KVA_INLINE uint32_t kva_var_split_tail(kva_var_range *ranges, uint32_t at, uint32_t length, uint32_t units) {
    uint32_t rest = at + units;
    ranges[rest].prev = at;
    ranges[rest].length = (length - units) | KVA_VAR_FREE_BIT;
    ranges[at + length].prev = rest; /* kva_var_link_follower(v, rest, length - units) */
    return rest;
}

/* The other split: the free range at `at` of `length` units gives its last `units` and keeps the
 * rest, shorter, under the same head (its free structure is the caller's to fix). Returns the
 * head of the part given, linked both ways, not yet marked used. */
KVA_INLINE uint32_t kva_var_split_front(kva_var_range *ranges, uint32_t at, uint32_t length, uint32_t units) {
    uint32_t given = at + length - units;
    ranges[given].prev = at;
    ranges[at].length = (length - units) | KVA_VAR_FREE_BIT;
    ranges[at + length].prev = given;
    return given;
}

/* Which end of the free range at `at` of `length` units best fit and TLSF carve `units` from
 * (the rule, its reason and its measurements: "Placement" above): the end beside the shorter
 * of the range's two neighbours, a pool edge counting as shorter than any range, so that
 * the remainder stays beside the longer neighbour; the low end on a tie, when the range is
 * taken whole, and for a request below KVA_VAR_CARVE_MIN units. Both neighbours are used (V2),
 * so their length fields hold no free bit, and a pool edge is the sentinel, whose length is 0:
 * the edge below the first range ties or loses, so that range is carved low, and the edge above
 * the last one wins. Returns nonzero for the high end. */
KVA_INLINE int kva_var_carve_high(const kva_var_range *ranges, uint32_t at, uint32_t length, uint32_t units) {
    if (units < KVA_VAR_CARVE_MIN || length == units) return 0;
    return ranges[at + length].length < ranges[ranges[at].prev].length;
}

/* Marks the range whose head record is r (no longer in any free structure) used for `size`
 * bytes. */
KVA_INLINE void kva_var_mark_used(kva_var *v, kva_var_range *r, uint32_t units, size_t size) {
    r->length = units;
    r->link_prev = (uint32_t)size;
    r->link_next = (uint32_t)((uint64_t)size >> 32);
    v->free_units -= units;
    if (v->free_units < v->low_free_units) v->low_free_units = v->free_units;
    v->requested_bytes += size;
    v->alloc_count++;
}

/* How every locked path of alloc and free ends. A caller that entered by the lock's bias passes
 * its flag (me) and the path leaves the lock; one that took the plain lock passes NULL and
 * releases it itself. The slow parts of a path are tail calls that take `me` and end here in
 * their turn, so the fast paths call nothing, and need no callee-saved registers. */
KVA_INLINE kva_status kva_var_leave(kva_lock_owner *me, kva_status st) {
    if (me) kva_lock_leave_biased(me);
    return st;
}

/* ---- between the files ---------------------------------------------------------------------- */

/* var_tlsf.c: the free range r (its length set) joins its TLSF class. */
void kva_var_tlsf_insert(kva_var *v, uint32_t r);

/* var_fit.c, first, best and worst fit: the free range r (its length set) joins the free list;
 * an allocation and the free of the used range at `at`, the lock held, each ending the locked
 * path (kva_var_leave). */
void kva_var_fit_insert(kva_var *v, uint32_t r);
kva_status kva_var_fit_alloc(kva_var *v, size_t size, void **out, kva_lock_owner *me);
kva_status kva_var_fit_release(kva_var *v, uint32_t at, kva_lock_owner *me);

/* var_reject.c. kva_var_alloc's arguments refused (the lock not held); no free range for a
 * request and why ptr cannot be freed, the lock held, each ending the locked path. The first two
 * always fail (kva_fail) and are declared cold, so that their callers keep the paths to them out
 * of line; a bad free's classification has a common part of its own. */
kva_status kva_var_alloc_rejected(kva_var *v, size_t size, void **out) __attribute__((cold));
kva_status kva_var_alloc_failed(kva_var *v, size_t size, uint32_t units, kva_lock_owner *me) __attribute__((cold));
kva_status kva_var_free_rejected(kva_var *v, void *ptr, kva_lock_owner *me);

#endif
