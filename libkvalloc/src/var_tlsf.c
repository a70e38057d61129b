/*
 * var_tlsf.c — TLSF's classes (var_pool.h), and kva_var_alloc and kva_var_free, into which TLSF's
 * common paths are inlined: calls under the other policies go on to var_fit.c, failed and refused
 * ones to var_reject.c.
 */
#include "var_pool.h"

/* Adds a free range to its class. The list order within a class is free to choose (every range
 * there is within 1/KVA_TLSF_SL of the others' length); the lower address of the new range and
 * the current head goes first, so the head is the lowest-addressed range of those added since it
 * became head. That is a constant-time approximation of address order, which keeps allocations
 * toward the low end and the large ranges whole: on bench_varpool's forward-pass trace it took
 * TLSF from above first fit's fragmentation to at or below it on each of 5 seeds. */
KVA_INLINE void tlsf_push_to(kva_var *v, kva_var_range *ranges, uint32_t r, unsigned cls) {
    uint32_t head = v->bins[cls];
    if (head < r) { /* second place (KVA_NIL, the empty class, exceeds every unit) */
        uint32_t next = ranges[head].link_next;
        ranges[r].link_prev = head;
        ranges[r].link_next = next;
        if (next != KVA_NIL) ranges[next].link_prev = r;
        ranges[head].link_next = r;
        return;
    }
    ranges[r].link_prev = KVA_NIL;
    ranges[r].link_next = head;
    if (head != KVA_NIL) {
        ranges[head].link_prev = r;
    } else { /* the class was empty */
        v->sl_map[cls / KVA_TLSF_SL] |= 1u << cls % KVA_TLSF_SL;
        v->fl_map |= 1u << cls / KVA_TLSF_SL;
    }
    v->bins[cls] = r;
}

static void tlsf_push(kva_var *v, uint32_t r) {
    tlsf_push_to(v, v->ranges, r, kva_tlsf_index(kva_var_len(&v->ranges[r])));
}

/* A free range joins its class: kva_var_create's first one. */
void kva_var_tlsf_insert(kva_var *v, uint32_t r) { tlsf_push(v, r); }

/* Class cls has become empty: its bits go. */
KVA_INLINE void tlsf_clear_class(kva_var *v, unsigned cls) {
    unsigned fl = cls / KVA_TLSF_SL;
    if ((v->sl_map[fl] &= ~(1u << cls % KVA_TLSF_SL)) == 0) v->fl_map &= ~(1u << fl);
}

/* Takes the free range r (of class cls) out of its class's list. */
KVA_INLINE void tlsf_unlink_from(kva_var *v, kva_var_range *ranges, uint32_t r, unsigned cls) {
    uint32_t prev = ranges[r].link_prev, next = ranges[r].link_next;
    if (prev != KVA_NIL) {
        ranges[prev].link_next = next;
    } else if ((v->bins[cls] = next) == KVA_NIL) {
        tlsf_clear_class(v, cls);
    }
    if (next != KVA_NIL) ranges[next].link_prev = prev;
}

static void tlsf_unlink(kva_var *v, uint32_t r) {
    tlsf_unlink_from(v, v->ranges, r, kva_tlsf_index(kva_var_len(&v->ranges[r])));
}

/* The slow half of tlsf_resize: the class changes. The old class is computed from old_len, the
 * new one once, and each list and bitmap touched once. */
static KVA_NOINLINE kva_status tlsf_move(kva_var *v, uint32_t old, uint32_t old_len, uint32_t fresh, uint32_t new_len,
                                         kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    tlsf_unlink_from(v, ranges, old, kva_tlsf_index(old_len));
    if (old != fresh) ranges[old] = (kva_var_range){0};
    ranges[fresh].length = new_len | KVA_VAR_FREE_BIT;
    tlsf_push_to(v, ranges, fresh, kva_tlsf_index(new_len));
    return kva_var_leave(me, KVA_OK);
}

/* Whether lengths a and b (a >= 1) fall in the same TLSF class: below KVA_TLSF_SL the same length;
 * above, the same bits down to the second level's, which a shift of the XOR tests without
 * computing either class. */
KVA_INLINE int tlsf_same_class(uint32_t a, uint32_t b) {
    return a < KVA_TLSF_SL ? a == b : ((a ^ b) >> (kva_log2(a) - KVA_TLSF_SL_LOG2)) == 0;
}

/* The free range `old` of old_len units becomes `fresh` of new_len units by a merge at either
 * end; old's record is cleared when fresh is another. While the class stays the same, which is
 * the common case for a large free range, fresh takes old's place in the class list and no bitmap
 * changes. Ends the locked path (kva_var_leave). */
KVA_INLINE kva_status tlsf_resize(kva_var *v, uint32_t old, uint32_t old_len, uint32_t fresh, uint32_t new_len,
                                  kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    if (kva_unlikely(!tlsf_same_class(old_len, new_len))) return tlsf_move(v, old, old_len, fresh, new_len, me);
    if (old != fresh) {
        uint32_t prev = ranges[old].link_prev, next = ranges[old].link_next;
        ranges[fresh].link_prev = prev;
        ranges[fresh].link_next = next;
        if (prev == KVA_NIL) {
            v->bins[kva_tlsf_index(old_len)] = fresh;
        } else {
            ranges[prev].link_next = fresh;
        }
        if (next != KVA_NIL) ranges[next].link_prev = fresh;
        ranges[old] = (kva_var_range){0};
    }
    ranges[fresh].length = new_len | KVA_VAR_FREE_BIT;
    return kva_var_leave(me, KVA_OK);
}

/* The first range of the request's own class that holds it, or KVA_NIL. */
static KVA_NOINLINE uint32_t tlsf_scan_class(const kva_var *v, uint32_t units) {
    for (uint32_t r = v->bins[kva_tlsf_index(units)]; r != KVA_NIL; r = v->ranges[r].link_next)
        if (kva_var_len(&v->ranges[r]) >= units) return r;
    return KVA_NIL;
}

/* ---- allocation --------------------------------------------------------------------------- */

/* Takes `units` from the free range at `at`, wherever it sits in its class, at the end the
 * placement rule picks (kva_var_carve_high): what is left goes back to its own class. Returns the head
 * of the part taken. */
static uint32_t tlsf_take(kva_var *v, uint32_t at, uint32_t units) {
    kva_var_range *ranges = v->ranges;
    uint32_t length = kva_var_len(&ranges[at]);
    tlsf_unlink(v, at);
    if (length == units) {
        v->free_ranges--;
        return at;
    }
    if (kva_var_carve_high(ranges, at, length, units)) {
        uint32_t given = kva_var_split_front(ranges, at, length, units);
        tlsf_push(v, at);
        return given;
    }
    tlsf_push(v, kva_var_split_tail(ranges, at, length, units));
    return at;
}

/* TLSF when the two-ctz search finds nothing: the request's own class may still hold a range
 * long enough beyond its head (the search skipped it). */
static KVA_NOINLINE kva_status tlsf_alloc_slow(kva_var *v, size_t size, void **out, uint32_t units,
                                               kva_lock_owner *me) {
    uint32_t at = tlsf_scan_class(v, units);
    if (at == KVA_NIL) return kva_var_alloc_failed(v, size, units, me);
    at = tlsf_take(v, at, units);
    kva_var_mark_used(v, &v->ranges[at], units, size);
    *out = v->base + ((size_t)at << v->align_shift);
    return kva_var_leave(me, KVA_OK);
}

/* kva_tlsf_floors (var_pool.h), built at compile time: the shortest length class (fl, sl) holds is
 * sl below KVA_TLSF_SL, else (KVA_TLSF_SL + sl) << (fl - 1). */
#define FLOOR_SHIFT(i) ((i) < KVA_TLSF_SL ? 0 : (i) / KVA_TLSF_SL - 1) /* never negative, even unused */
#define FLOOR_OF(i) ((uint32_t)((i) < KVA_TLSF_SL ? (i) : (KVA_TLSF_SL + (i) % KVA_TLSF_SL) << FLOOR_SHIFT(i)))
#define FLOORS_4(i) FLOOR_OF(i), FLOOR_OF((i) + 1), FLOOR_OF((i) + 2), FLOOR_OF((i) + 3)
#define FLOORS_32(i)                                                                                               \
    FLOORS_4(i), FLOORS_4((i) + 4), FLOORS_4((i) + 8), FLOORS_4((i) + 12), FLOORS_4((i) + 16), FLOORS_4((i) + 20), \
        FLOORS_4((i) + 24), FLOORS_4((i) + 28)
#define FLOORS_288(i)                                                                                  \
    FLOORS_32(i), FLOORS_32((i) + 32), FLOORS_32((i) + 64), FLOORS_32((i) + 96), FLOORS_32((i) + 128), \
        FLOORS_32((i) + 160), FLOORS_32((i) + 192), FLOORS_32((i) + 224), FLOORS_32((i) + 256)
_Static_assert(KVA_TLSF_FL *KVA_TLSF_SL == 3 * 288, "kva_tlsf_floors lists 3 x 288 classes");
const uint32_t kva_tlsf_floors[KVA_TLSF_FL * KVA_TLSF_SL] = {FLOORS_288(0), FLOORS_288(288), FLOORS_288(576)};
#undef FLOOR_SHIFT
#undef FLOOR_OF
#undef FLOORS_4
#undef FLOORS_32
#undef FLOORS_288

/* Removes the head of class (fl, sl), whose successor is `next`. */
KVA_INLINE void tlsf_pop_head(kva_var *v, unsigned fl, unsigned sl, uint32_t next) {
    v->bins[fl * KVA_TLSF_SL + sl] = next;
    if (next != KVA_NIL) v->ranges[next].link_prev = KVA_NIL;
    else if ((v->sl_map[fl] &= ~(1u << sl)) == 0) v->fl_map &= ~(1u << fl);
}

/* A split's tail falls below its class: the head of (fl, sl), already used, leaves the class and
 * the tail `rest` (its length set) joins its own. */
static KVA_NOINLINE kva_status tlsf_requeue(kva_var *v, unsigned fl, unsigned sl, uint32_t next, uint32_t rest,
                                            kva_lock_owner *me) {
    tlsf_pop_head(v, fl, sl, next);
    tlsf_push(v, rest);
    return kva_var_leave(me, KVA_OK);
}

/* The head of the first nonempty class of level fl among those in sl_bits, else of the first
 * nonempty class of a higher level: two ctz. Sets *fl and *sl to the class; KVA_NIL when every
 * class there is empty. */
KVA_INLINE uint32_t tlsf_search(const kva_var *v, unsigned *fl, unsigned *sl, uint32_t sl_bits) {
    if (sl_bits == 0) {
        uint32_t fl_bits = v->fl_map & (~0u << (*fl + 1)); /* fl + 1 <= KVA_TLSF_FL < 32 */
        if (fl_bits == 0) return KVA_NIL;
        *fl = (unsigned)__builtin_ctz(fl_bits);
        sl_bits = v->sl_map[*fl];
    }
    *sl = (unsigned)__builtin_ctz(sl_bits);
    return v->bins[*fl * KVA_TLSF_SL + *sl];
}

/* The search found the head of a class, longer than the request, and the rule carves its high
 * end (kva_var_carve_high): the front stays the class's head, shorter, unless that takes it below the
 * class's floor. The class and the request's units are derived again rather than passed, so that
 * the call from tlsf_alloc stays a tail call (arguments in registers). */
static KVA_NOINLINE kva_status tlsf_alloc_high(kva_var *v, uint32_t at, size_t size, void **out, kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    uint32_t units = (uint32_t)((size + v->align_mask) >> v->align_shift);
    uint32_t length = kva_var_len(&ranges[at]), next = ranges[at].link_next;
    unsigned fl, sl;
    kva_tlsf_class(length, &fl, &sl);
    uint32_t given = kva_var_split_front(ranges, at, length, units);
    kva_var_mark_used(v, &ranges[given], units, size);
    *out = v->base + ((size_t)given << v->align_shift);
    if (length - units < kva_tlsf_floors[fl * KVA_TLSF_SL + sl]) {
        tlsf_pop_head(v, fl, sl, next);
        tlsf_push(v, at);
    }
    return kva_var_leave(me, KVA_OK);
}

/* TLSF allocation, any request (tlsf_alloc's fast path covers the common case). The search:
 * first the head of the request's own class, which when it holds the request fits more closely
 * than anything above (a tensor shape
 * that recurs finds the range its last instance freed instead of splitting a larger one); else
 * the first nonempty class above the request's own, where every range holds it: two ctz. Below
 * KVA_TLSF_SL units a class is one length, so the search starts at the request's class. When
 * that finds nothing the own class may still hold a long enough range beyond its head: it is
 * scanned on that failure path only (tlsf_alloc_slow), so TLSF fails no more often than an exact
 * fit would.
 * A request of KVA_TLSF_SL units or more may be carved from the high end of the range
 * (kva_var_carve_high, tlsf_alloc_high); KVA_VAR_CARVE_MIN is KVA_TLSF_SL, so a shorter one, on its own
 * branch, needs no test and takes the low end as before.
 * The range found is the head of class (fl, sl), so unlinking it needs no neighbour's link, and
 * the tail a split leaves stays in the class exactly when it is at least the class's floor; then
 * it takes the head's place and no bitmap changes. */
_Static_assert(KVA_VAR_CARVE_MIN >= KVA_TLSF_SL, "tlsf_alloc tests the placement rule only from KVA_TLSF_SL units");
static KVA_NOINLINE kva_status tlsf_alloc_any(kva_var *v, size_t size, void **out, kva_lock_owner *me) {
    uint32_t units = (uint32_t)((size + v->align_mask) >> v->align_shift);
    kva_var_range *ranges = v->ranges;
    unsigned fl, sl;
    uint32_t at;
    if (units < KVA_TLSF_SL) { /* one length per class: the first nonempty at or above */
        fl = 0;
        at = tlsf_search(v, &fl, &sl, v->sl_map[0] & (~0u << units));
        if (kva_unlikely(at == KVA_NIL)) return tlsf_alloc_slow(v, size, out, units, me);
    } else {
        kva_tlsf_class(units, &fl, &sl);
        at = v->bins[fl * KVA_TLSF_SL + sl]; /* the own class's head, if it holds the request */
        if (at == KVA_NIL || kva_var_len(&ranges[at]) < units) {
            at = tlsf_search(v, &fl, &sl, sl + 1 < KVA_TLSF_SL ? v->sl_map[fl] & (~0u << (sl + 1)) : 0);
            if (kva_unlikely(at == KVA_NIL)) return tlsf_alloc_slow(v, size, out, units, me);
        }
        if (kva_var_carve_high(ranges, at, kva_var_len(&ranges[at]), units))
            return tlsf_alloc_high(v, at, size, out, me);
    }
    /* The range is marked used and handed out first, so that little stays live across the
     * list work that follows. */
    kva_var_range *r = &ranges[at];
    uint32_t length = kva_var_len(r), next = r->link_next;
    kva_var_mark_used(v, r, units, size);
    *out = v->base + ((size_t)at << v->align_shift);
    if (length > units) {
        uint32_t rest = kva_var_split_tail(ranges, at, length, units);
        kva_var_range *t = &ranges[rest];
        if (kva_unlikely(length - units < kva_tlsf_floors[fl * KVA_TLSF_SL + sl]))
            return tlsf_requeue(v, fl, sl, next, rest, me);
        t->link_prev = KVA_NIL; /* the tail takes the head's place */
        t->link_next = next;
        if (next != KVA_NIL) ranges[next].link_prev = rest;
        v->bins[fl * KVA_TLSF_SL + sl] = rest;
    } else {
        tlsf_pop_head(v, fl, sl, next);
        v->free_ranges--;
    }
    return kva_var_leave(me, KVA_OK);
}

/* Every policy's allocation, with the lock held. */
static KVA_NOINLINE kva_status alloc_any(kva_var *v, size_t size, void **out, kva_lock_owner *me) {
    if (v->policy == KVA_VAR_TLSF) return tlsf_alloc_any(v, size, out, me);
    return kva_var_fit_alloc(v, size, out, me);
}

/* TLSF allocation, inlined into kva_var_alloc: the common case of a request below KVA_TLSF_SL
 * units (256 B .. 8 KiB at the default alignment) is done here, and everything else is
 * alloc_any's. The common case: the search (the first nonempty class at or above the
 * request's, one length per class there; else the first nonempty level above, whose every class
 * holds the request) finds a class head that stays in its class once the request is cut from
 * its low end (its floor is one load from kva_tlsf_floors). Then only the head moves, to the
 * remainder's first unit, in the same list place, and no class or bitmap changes; nor does the
 * placement rule apply (small requests take the low end, var_pool.h). A head that would fall
 * below its class, an exact fit, an empty pool, another policy: alloc_any decides, searching
 * again. */
KVA_INLINE kva_status tlsf_alloc(kva_var *v, size_t size, void **out, kva_lock_owner *me) {
    uint32_t units = (uint32_t)((size + v->align_mask) >> v->align_shift);
    /* A range of the first level (one length per class, below KVA_TLSF_SL) that holds the
     * request is an exact fit or leaves a remainder of another class. */
    uint32_t fl_bits = v->fl_map & ~1u;
    if (units >= KVA_TLSF_SL || (v->sl_map[0] & (~0u << units)) != 0 || fl_bits == 0)
        return alloc_any(v, size, out, me);
    unsigned fl = (unsigned)__builtin_ctz(fl_bits), sl = (unsigned)__builtin_ctz(v->sl_map[fl]);
    unsigned cls = fl * KVA_TLSF_SL + sl;
    uint32_t at = v->bins[cls];
    kva_var_range *r = &v->ranges[at];
    uint32_t length = kva_var_len(r), rest_len = length - units;
    if (rest_len < kva_tlsf_floors[cls]) return alloc_any(v, size, out, me);
    /* The request is done first (its size and out are then dead, which spares registers); the
     * remainder's records are written after. */
    uint32_t next = r->link_next;
    *out = v->base + (size_t)at * v->alignment;
    kva_var_mark_used(v, r, units, size);
    uint32_t rest = at + units;
    kva_var_range *t = r + units;
    t->length = rest_len | KVA_VAR_FREE_BIT;
    t->prev = at;
    t->link_prev = KVA_NIL;
    t->link_next = next;
    r[length].prev = rest;
    if (next != KVA_NIL) v->ranges[next].link_prev = rest; /* below the head as often as above */
    v->bins[cls] = rest;
    return kva_var_leave(me, KVA_OK);
}

/* TLSF's fast path needs no test of the policy: the other policies never set a bit of the
 * class maps, so it hands them to alloc_any with TLSF's own misses. */
KVA_INLINE kva_status alloc_locked(kva_var *v, size_t size, void **out, kva_lock_owner *me) {
    return tlsf_alloc(v, size, out, me);
}

/* The lock taken the plain way (kva_var_alloc's slow path). */
static KVA_NOINLINE kva_status alloc_plain(kva_var *v, size_t size, void **out) {
    int token = kva_lock_acquire_plain(&v->lock);
    kva_status st = alloc_locked(v, size, out, NULL);
    kva_lock_release(&v->lock, token);
    return st;
}

kva_status kva_var_alloc(kva_var *v, size_t size, void **out) {
    /* One test for the arguments: size - 1 wraps for 0. */
    if (kva_unlikely(!v || !out || size - 1 >= v->bytes)) return kva_var_alloc_rejected(v, size, out);
    kva_lock_owner *me = kva_lock_enter_biased(&v->lock);
    if (kva_unlikely(me == NULL)) return alloc_plain(v, size, out);
    return alloc_locked(v, size, out, me);
}

/* ---- free --------------------------------------------------------------------------------- */

/* A freed range with free ranges on both sides: the three become the previous one. */
static KVA_NOINLINE kva_status tlsf_merge_three(kva_var *v, uint32_t at, uint32_t prev, uint32_t next,
                                                kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    uint32_t prev_len = kva_var_len(&ranges[prev]);
    uint32_t total = prev_len + ranges[at].length + kva_var_len(&ranges[next]);
    tlsf_unlink(v, next);
    ranges[next] = (kva_var_range){0};
    ranges[at] = (kva_var_range){0};
    kva_var_link_follower(v, prev, total);
    v->free_ranges--;
    return tlsf_resize(v, prev, prev_len, prev, total, me);
}

/* A freed range with no free neighbour joins its class. */
static KVA_NOINLINE kva_status tlsf_insert(kva_var *v, uint32_t at, kva_lock_owner *me) {
    v->ranges[at].length |= KVA_VAR_FREE_BIT; /* the range after it still names it as prev */
    v->free_ranges++;
    tlsf_push(v, at);
    return kva_var_leave(me, KVA_OK);
}

/* TLSF free of the used range at `at` whose previous range is not free: it merges with the next
 * one when that is free (the merged range takes the next one's place in its class when the class
 * does not change, tlsf_resize), else joins its class alone. */
static KVA_NOINLINE kva_status tlsf_release_forward(kva_var *v, uint32_t at, kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    uint32_t length = ranges[at].length, next = at + length;
    if (kva_var_is_free(&ranges[next])) {
        uint32_t next_len = kva_var_len(&ranges[next]), total = length + next_len;
        kva_var_link_follower(v, at, total);
        return tlsf_resize(v, next, next_len, at, total, me);
    }
    return tlsf_insert(v, at, me);
}

/* TLSF free of the used range at `at`, merging it with free neighbours; inlined into
 * kva_var_free. The common case stays here: the range before is free and the one after is not
 * (frees in the order of allocation), so the previous range grows in place and keeps its place
 * in its class unless its class changes (tlsf_move). Ends the locked path (kva_var_leave). */
KVA_INLINE kva_status tlsf_release(kva_var *v, uint32_t at, kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges, *r = &ranges[at];
    uint32_t length = r->length, next = at + length, prev = r->prev;
    v->free_units += length;
    v->requested_bytes -= kva_var_requested(r);
    v->free_count++;
    if (!kva_var_is_free(&ranges[prev])) return tlsf_release_forward(v, at, me);
    if (kva_unlikely(kva_var_is_free(&ranges[next]))) return tlsf_merge_three(v, at, prev, next, me);
    uint32_t prev_len = kva_var_len(&ranges[prev]), total = prev_len + length;
    *r = (kva_var_range){0};
    ranges[next].prev = prev; /* kva_var_link_follower, with `next` known */
    if (kva_unlikely(!tlsf_same_class(prev_len, total))) return tlsf_move(v, prev, prev_len, prev, total, me);
    ranges[prev].length = total | KVA_VAR_FREE_BIT;
    return kva_var_leave(me, KVA_OK);
}

KVA_INLINE kva_status free_locked(kva_var *v, void *ptr, kva_lock_owner *me) {
    /* One test for everything that is not the start of a live range: NULL falls outside the
     * region (its offset, 0 - base, exceeds any user-space region's size), and a used head has a
     * length in [1, KVA_VAR_MAX_UNITS], so one compare excludes free ranges (free bit set) and
     * records inside ranges (0). */
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)v->base;
    uint32_t at = (uint32_t)(offset >> v->align_shift);
    if (kva_likely(offset < v->bytes && (offset & v->align_mask) == 0 &&
                   v->ranges[at].length - 1u < KVA_VAR_MAX_UNITS)) {
        if (kva_likely(v->policy == KVA_VAR_TLSF)) return tlsf_release(v, at, me);
        return kva_var_fit_release(v, at, me);
    }
    return kva_var_free_rejected(v, ptr, me);
}

/* The lock taken the plain way (kva_var_free's slow path). */
static KVA_NOINLINE kva_status free_plain(kva_var *v, void *ptr) {
    int token = kva_lock_acquire_plain(&v->lock);
    kva_status st = free_locked(v, ptr, NULL);
    kva_lock_release(&v->lock, token);
    return st;
}

kva_status kva_var_free(kva_var *v, void *ptr) {
    if (kva_unlikely(v == NULL)) return kva_fail(KVA_ERR_INVALID, "variable-size pool is NULL");
    kva_lock_owner *me = kva_lock_enter_biased(&v->lock);
    if (kva_unlikely(me == NULL)) return free_plain(v, ptr);
    return free_locked(v, ptr, me);
}
