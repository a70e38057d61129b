/*
 * var_fit.c — first, best and worst fit (var_pool.h): the free ranges in one doubly linked list,
 * in address or in length order; allocation and free under those policies, to which
 * kva_var_alloc and kva_var_free (var_tlsf.c) hand their calls.
 */
#include "var_pool.h"

/* Links r after `after` (KVA_NIL: at the head) in the first, best or worst fit list. */
static void list_link_after(kva_var *v, uint32_t r, uint32_t after) {
    kva_var_range *ranges = v->ranges;
    uint32_t next = after == KVA_NIL ? v->head : ranges[after].link_next;
    ranges[r].link_prev = after;
    ranges[r].link_next = next;
    if (after == KVA_NIL) v->head = r;
    else ranges[after].link_next = r;
    if (next == KVA_NIL) v->tail = r;
    else ranges[next].link_prev = r;
}

static void list_unlink(kva_var *v, uint32_t r) {
    kva_var_range *ranges = v->ranges;
    uint32_t prev = ranges[r].link_prev, next = ranges[r].link_next;
    if (prev == KVA_NIL) v->head = next;
    else ranges[prev].link_next = next;
    if (next == KVA_NIL) v->tail = prev;
    else ranges[next].link_prev = prev;
}

/* First fit: `fresh` takes the place of `old` in the address-ordered list. Used when a split or
 * a merge keeps the list order, so that no walk is needed. */
static void list_replace(kva_var *v, uint32_t old, uint32_t fresh) {
    kva_var_range *ranges = v->ranges;
    uint32_t prev = ranges[old].link_prev, next = ranges[old].link_next;
    ranges[fresh].link_prev = prev;
    ranges[fresh].link_next = next;
    if (prev == KVA_NIL) v->head = fresh;
    else ranges[prev].link_next = fresh;
    if (next == KVA_NIL) v->tail = fresh;
    else ranges[next].link_prev = fresh;
}

/* Adds the free range r (its length already set) to the policy's list. */
void kva_var_fit_insert(kva_var *v, uint32_t r) {
    kva_var_range *ranges = v->ranges;
    uint32_t length = kva_var_len(&ranges[r]);
    uint32_t after = KVA_NIL;
    switch (v->policy) {
    case KVA_VAR_TLSF: /* not a list: its classes are var_tlsf.c's (kva_var_tlsf_insert) */ return;
    case KVA_VAR_FIRST_FIT:
        /* The free range before r in address order is the nearest free head behind it. */
        for (uint32_t at = ranges[r].prev; at != v->units; at = ranges[at].prev) /* to the sentinel */
            if (kva_var_is_free(&ranges[at])) {
                after = at;
                break;
            }
        break;
    case KVA_VAR_BEST_FIT:
        /* Equal lengths in address order: address-ordered best fit, which packs toward the
         * start of the region and keeps the large ranges whole. */
        for (uint32_t at = v->head; at != KVA_NIL; at = ranges[at].link_next) {
            uint32_t len = kva_var_len(&ranges[at]);
            if (len > length || (len == length && at > r)) break;
            after = at;
        }
        break;
    case KVA_VAR_WORST_FIT:
        /* Worst fit mostly reinserts large remainders: walk from the large end. */
        after = v->tail;
        while (after != KVA_NIL &&
               (kva_var_len(&ranges[after]) > length || (kva_var_len(&ranges[after]) == length && after > r)))
            after = ranges[after].link_prev;
        break;
    }
    list_link_after(v, r, after);
}

/* First, best and worst fit: a free range of at least `units`, or KVA_NIL. */
static uint32_t free_find(const kva_var *v, uint32_t units) {
    const kva_var_range *ranges = v->ranges;
    switch (v->policy) {
    case KVA_VAR_TLSF: /* tlsf_alloc searches itself */ return KVA_NIL;
    case KVA_VAR_FIRST_FIT:
    case KVA_VAR_BEST_FIT: /* the first that fits: lowest address, or shortest */
        for (uint32_t at = v->head; at != KVA_NIL; at = ranges[at].link_next)
            if (kva_var_len(&ranges[at]) >= units) return at;
        return KVA_NIL;
    case KVA_VAR_WORST_FIT: return v->tail != KVA_NIL && kva_var_len(&ranges[v->tail]) >= units ? v->tail : KVA_NIL;
    }
    return KVA_NIL;
}

/* First, best and worst fit. */
KVA_NOINLINE kva_status kva_var_fit_alloc(kva_var *v, size_t size, void **out, kva_lock_owner *me) {
    uint32_t units = (uint32_t)((size + v->align_mask) >> v->align_shift);
    uint32_t at = free_find(v, units);
    if (kva_unlikely(at == KVA_NIL)) return kva_var_alloc_failed(v, size, units, me);
    kva_var_range *ranges = v->ranges;
    uint32_t length = kva_var_len(&ranges[at]);
    if (v->policy == KVA_VAR_BEST_FIT && kva_var_carve_high(ranges, at, length, units)) {
        /* The front stays free under its head, shorter: it moves down the length order. */
        list_unlink(v, at);
        uint32_t given = kva_var_split_front(ranges, at, length, units);
        kva_var_fit_insert(v, at);
        at = given;
    } else if (length > units) {
        /* Split: the tail stays free. In address order it takes the place of the whole. First
         * and worst fit always carve the low end: first fit's address order is what it is
         * measured by, and the rule would undo it (var_pool.h, "Placement"). */
        uint32_t rest = kva_var_split_tail(ranges, at, length, units);
        if (v->policy == KVA_VAR_FIRST_FIT) {
            list_replace(v, at, rest);
        } else {
            list_unlink(v, at);
            kva_var_fit_insert(v, rest);
        }
    } else {
        list_unlink(v, at);
        v->free_ranges--;
    }
    kva_var_mark_used(v, &ranges[at], units, size);
    *out = v->base + ((size_t)at << v->align_shift);
    return kva_var_leave(me, KVA_OK);
}

/* First, best and worst fit: frees the used range at `at`, merging it with free neighbours. */
KVA_NOINLINE kva_status kva_var_fit_release(kva_var *v, uint32_t at, kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    uint32_t length = ranges[at].length;
    v->free_units += length;
    v->requested_bytes -= kva_var_requested(&ranges[at]);
    uint32_t next = at + length, prev = ranges[at].prev;
    int next_free = kva_var_is_free(&ranges[next]), prev_free = kva_var_is_free(&ranges[prev]); /* not the sentinel */
    uint32_t start = at, total = length;
    if (v->policy == KVA_VAR_FIRST_FIT) {
        /* Address order survives every merge: the merged range takes the place of the free
         * neighbour before it, or else of the one after it; only a lone range walks. */
        if (next_free) {
            total += kva_var_len(&ranges[next]);
            if (prev_free) list_unlink(v, next);
            else list_replace(v, next, at);
            ranges[next] = (kva_var_range){0};
        }
        if (prev_free) {
            total += kva_var_len(&ranges[prev]);
            ranges[at] = (kva_var_range){0};
            start = prev;
        }
        ranges[start].length = total | KVA_VAR_FREE_BIT;
        if (!next_free && !prev_free) kva_var_fit_insert(v, start);
    } else {
        if (next_free) {
            list_unlink(v, next);
            total += kva_var_len(&ranges[next]);
            ranges[next] = (kva_var_range){0};
        }
        if (prev_free) {
            list_unlink(v, prev);
            total += kva_var_len(&ranges[prev]);
            ranges[at] = (kva_var_range){0};
            start = prev;
        }
        ranges[start].length = total | KVA_VAR_FREE_BIT;
        kva_var_fit_insert(v, start);
    }
    kva_var_link_follower(v, start, total);
    v->free_ranges = v->free_ranges + 1 - (uint64_t)next_free - (uint64_t)prev_free;
    v->free_count++;
    return kva_var_leave(me, KVA_OK);
}
