/*
 * var_check.c — kva_var_check: walks every invariant stated in var_pool.h and names the first
 * one broken. O(capacity / alignment); never on a hot path.
 */

#include "var_pool.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

typedef struct tally {
    uint64_t free_units, free_ranges, live, requested;
} tally;

static kva_status check_tiling(const kva_var *v, tally *t) {
    const kva_var_range *ranges = v->ranges;
    uint32_t at = 0, prev = v->units; /* the first range's prev is the sentinel */
    int prev_free = 0;
    while (at < v->units) {
        const kva_var_range *r = &ranges[at];
        uint32_t length = kva_var_len(r);
        if (length == 0) return BROKEN("V1: unit %u should head a range but its record is empty", at);
        if (length > v->units - at)
            return BROKEN("V1: range %u of %u units runs past the end (%u)", at, length, v->units);
        if (r->prev != prev) return BROKEN("V1: range %u says its previous range is %u, not %u", at, r->prev, prev);
        for (uint32_t inner = at + 1; inner < at + length; inner++) {
            const kva_var_range *q = &ranges[inner];
            if (q->length | q->prev | q->link_prev | q->link_next)
                return BROKEN("V1: record %u inside range %u is not empty", inner, at);
        }
        int is_free = kva_var_is_free(r);
        if (is_free && prev_free) return BROKEN("V2: free ranges %u and %u are adjacent", prev, at);
        if (is_free) {
            t->free_units += length;
            t->free_ranges++;
        } else {
            uint64_t requested = kva_var_requested(r);
            uint64_t unit = (uint64_t)1 << v->align_shift;
            if (requested == 0 || (requested + unit - 1) >> v->align_shift != length)
                return BROKEN("V5: range %u of %u units records a request of %llu B", at, length,
                              (unsigned long long)requested);
            t->live++;
            t->requested += requested;
        }
        prev = at;
        prev_free = is_free;
        at += length;
    }
    if (at != v->units) return BROKEN("V1: the ranges end at %u, not at %u", at, v->units);
    const kva_var_range *sentinel = &ranges[at];
    if (sentinel->length | sentinel->link_prev | sentinel->link_next)
        return BROKEN("V1: the sentinel record after the last unit (%u) is not empty", at);
    if (sentinel->prev != prev)
        return BROKEN("V1: the sentinel says the last range is %u, not %u", sentinel->prev, prev);
    return KVA_OK;
}

/* One doubly linked list of free ranges from `head`: every element a free head, the back links
 * right, at most `limit` elements (a cycle would exceed it). *count and *last receive its length
 * and its last element. `order` 0: none; 1: ascending address; 2: nondecreasing length, equal
 * lengths in ascending address. */
static kva_status check_list(const kva_var *v, uint32_t head, int order, uint64_t limit, const char *what,
                             uint64_t *count, uint32_t *last) {
    const kva_var_range *ranges = v->ranges;
    uint32_t prev = KVA_NIL;
    uint64_t n = 0;
    for (uint32_t at = head; at != KVA_NIL; at = ranges[at].link_next) {
        if (at >= v->units) return BROKEN("V3: %s links to %u, past the end", what, at);
        const kva_var_range *r = &ranges[at];
        if (r->length == 0 || !kva_var_is_free(r)) return BROKEN("V3: %s holds %u, not a free range", what, at);
        if (r->link_prev != prev) return BROKEN("V3: range %u on %s has a wrong back link", at, what);
        if (prev != KVA_NIL && order == 1 && prev >= at)
            return BROKEN("V3: %s is not in address order at %u", what, at);
        if (prev != KVA_NIL && order == 2 &&
            (kva_var_len(&ranges[prev]) > kva_var_len(r) ||
             (kva_var_len(&ranges[prev]) == kva_var_len(r) && prev > at)))
            return BROKEN("V3: %s is not in length and address order at %u", what, at);
        if (++n > limit) return BROKEN("V3: %s is longer than the %llu free ranges", what, (unsigned long long)limit);
        prev = at;
    }
    *count += n;
    *last = prev;
    return KVA_OK;
}

static kva_status check_tlsf(const kva_var *v, uint64_t limit, uint64_t *count) {
    /* A bit past the last class would send the allocation's search past the class tables. */
    if ((uint64_t)v->fl_map >> KVA_TLSF_FL)
        return BROKEN("V4: first-level bits %#llx name classes past the last (%u)",
                      (unsigned long long)((uint64_t)v->fl_map >> KVA_TLSF_FL << KVA_TLSF_FL), KVA_TLSF_FL - 1);
    for (unsigned fl = 0; fl < KVA_TLSF_FL; fl++) {
        if (((v->fl_map >> fl) & 1) != (v->sl_map[fl] != 0))
            return BROKEN("V4: first-level bit %u disagrees with its second-level map %#x", fl, v->sl_map[fl]);
        for (unsigned sl = 0; sl < KVA_TLSF_SL; sl++) {
            uint32_t head = v->bins[fl * KVA_TLSF_SL + sl], last;
            if (((v->sl_map[fl] >> sl) & 1) != (head != KVA_NIL))
                return BROKEN("V4: bit (%u, %u) disagrees with its class list", fl, sl);
            kva_status st = check_list(v, head, 0, limit, "a TLSF class", count, &last);
            if (st != KVA_OK) return st;
            if (*count > limit)
                return BROKEN("V3: the TLSF classes hold more than %llu ranges", (unsigned long long)limit);
            for (uint32_t at = head; at != KVA_NIL; at = v->ranges[at].link_next) {
                unsigned f, s;
                kva_tlsf_class(kva_var_len(&v->ranges[at]), &f, &s);
                if (f != fl || s != sl)
                    return BROKEN("V4: range %u of %u units is in class (%u, %u), not (%u, %u)", at,
                                  kva_var_len(&v->ranges[at]), fl, sl, f, s);
            }
        }
    }
    return KVA_OK;
}

static const char *policy_name(kva_var_policy policy) {
    return policy == KVA_VAR_FIRST_FIT ? "first-fit" : policy == KVA_VAR_BEST_FIT ? "best-fit" : "worst-fit";
}

static kva_status check_free_structure(const kva_var *v, uint64_t free_ranges) {
    uint64_t count = 0;
    uint32_t last = KVA_NIL;
    kva_status st;
    if (v->policy == KVA_VAR_TLSF) {
        st = check_tlsf(v, free_ranges, &count);
    } else {
        /* kva_var_alloc's TLSF fast path tells the policies apart by the maps alone. */
        if (v->fl_map != 0)
            return BROKEN("V4: a %s pool has TLSF's first-level map %#x set", policy_name(v->policy), v->fl_map);
        for (unsigned fl = 0; fl < KVA_TLSF_FL; fl++)
            if (v->sl_map[fl] != 0)
                return BROKEN("V4: a %s pool has TLSF's second-level map %u set (%#x)", policy_name(v->policy), fl,
                              v->sl_map[fl]);
        st = check_list(v, v->head, v->policy == KVA_VAR_FIRST_FIT ? 1 : 2, free_ranges, "the free list", &count,
                        &last);
        if (st == KVA_OK && v->policy != KVA_VAR_FIRST_FIT && v->tail != last)
            return BROKEN("V3: the free list's tail is %u, its last element %u", v->tail, last);
    }
    if (st != KVA_OK) return st;
    if (count != free_ranges)
        return BROKEN("V3: the free structure holds %llu ranges, the region %llu", (unsigned long long)count,
                      (unsigned long long)free_ranges);
    return KVA_OK;
}

static kva_status check_locked(const kva_var *v) {
    tally t = {0};
    kva_status st = check_tiling(v, &t);
    if (st != KVA_OK) return st;
    /* Each listed element is a distinct free head (the lists are acyclic and the classes and
     * list positions disjoint), so equal counts mean every free range is listed exactly once. */
    st = check_free_structure(v, t.free_ranges);
    if (st != KVA_OK) return st;
    if (t.free_units != v->free_units)
        return BROKEN("V5: the ranges hold %llu free units, the counter says %llu", (unsigned long long)t.free_units,
                      (unsigned long long)v->free_units);
    uint64_t live = v->alloc_count - v->free_count;
    if (t.free_ranges != v->free_ranges || t.live != live || t.requested != v->requested_bytes)
        return BROKEN("V5: counted %llu free ranges, %llu live, %llu B requested; the counters say %llu, %llu, %llu",
                      (unsigned long long)t.free_ranges, (unsigned long long)t.live, (unsigned long long)t.requested,
                      (unsigned long long)v->free_ranges, (unsigned long long)live,
                      (unsigned long long)v->requested_bytes);
    return KVA_OK;
}

kva_status kva_var_check(kva_var *v) {
    if (!v) return kva_fail(KVA_ERR_INVALID, "variable-size pool is NULL");
    int token = kva_lock_acquire(&v->lock);
    kva_status st = check_locked(v);
    kva_lock_release(&v->lock, token);
    return st;
}
