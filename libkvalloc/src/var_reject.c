/*
 * var_reject.c — the calls on a variable-size pool that fail (var_pool.h): each counted and told
 * why, whether no free range holds a request, an argument is refused, or a pointer is not the
 * start of a live range (freed already, inside a range, outside the pool). None is on a fast path.
 */
#include "var_pool.h"

/* Counts a refused call (the lock held) and returns its status. */
static kva_status reject(kva_var *v, kva_status status) {
    v->rejected_calls++;
    return status;
}

/* The arguments are decided by fields fixed at creation; only the count takes the lock. */
KVA_NOINLINE kva_status kva_var_alloc_rejected(kva_var *v, size_t size, void **out) {
    if (!v) return kva_fail(KVA_ERR_INVALID, "variable-size pool is NULL");
    /* A forked child's copy (bytes 0 sends every request here): a valid one is refused as such,
     * not counted as bad input. */
    if (v->inherited && out && size - 1 < (size_t)v->units << v->align_shift) return kva_var_refuse_inherited();
    kva_status st = !out        ? kva_fail(KVA_ERR_INVALID, "out is NULL")
                    : size == 0 ? kva_fail(KVA_ERR_INVALID, "size 0")
                                : kva_fail(KVA_ERR_INVALID, "size %zu exceeds the capacity (%zu)", size,
                                           (size_t)v->units << v->align_shift);
    int token = kva_lock_acquire(&v->lock);
    reject(v, st);
    kva_lock_release(&v->lock, token);
    return st;
}

KVA_NOINLINE kva_status kva_var_alloc_failed(kva_var *v, size_t size, uint32_t units, kva_lock_owner *me) {
    v->alloc_failures++;
    return kva_var_leave(me, kva_fail(KVA_ERR_NOMEM, "no free range of %u units of %zu B for %zu B (%llu units free)",
                                      units, (size_t)1 << v->align_shift, size, (unsigned long long)v->free_units));
}

/* The free range that holds unit `at`, or KVA_NIL: a walk over the free ranges, in whichever
 * structure the policy keeps them. */
static uint32_t free_range_holding(const kva_var *v, uint32_t at) {
    const kva_var_range *ranges = v->ranges;
    if (v->policy != KVA_VAR_TLSF) {
        for (uint32_t r = v->head; r != KVA_NIL; r = ranges[r].link_next)
            if (r <= at && at - r < kva_var_len(&ranges[r])) return r;
        return KVA_NIL;
    }
    for (unsigned cls = 0; cls < KVA_TLSF_FL * KVA_TLSF_SL; cls++)
        for (uint32_t r = v->bins[cls]; r != KVA_NIL; r = ranges[r].link_next)
            if (r <= at && at - r < kva_var_len(&ranges[r])) return r;
    return KVA_NIL;
}

/* Why a unit that is not a used head cannot be freed: the range that holds it is free or live.
 * That range's head is the nearest head at or before it (every record inside a range is zero),
 * when a short look back finds one; else it is free exactly when one of the free ranges holds
 * the unit. */
static kva_status classify_bad_free(const kva_var *v, const void *ptr, uint64_t offset) {
    uint32_t unit = (uint32_t)(offset >> v->align_shift), at = unit;
    while (at > 0 && unit - at < KVA_VAR_BACK_SCAN && v->ranges[at].length == 0) at--;
    if (v->ranges[at].length == 0 && at > 0) {
        uint32_t r = free_range_holding(v, unit);
        if (r != KVA_NIL) at = r;
        else
            return kva_fail(KVA_ERR_BAD_POINTER, "%p (offset %llu) is inside a live range, not at its start", ptr,
                            (unsigned long long)offset);
    }
    uint64_t head = (uint64_t)at << v->align_shift;
    if (kva_var_is_free(&v->ranges[at]))
        return kva_fail(KVA_ERR_DOUBLE_FREE, "%p (offset %llu) lies in the free range at offset %llu", ptr,
                        (unsigned long long)offset, (unsigned long long)head);
    return kva_fail(KVA_ERR_BAD_POINTER, "%p (offset %llu) is inside the live range at offset %llu", ptr,
                    (unsigned long long)offset, (unsigned long long)head);
}

/* Why ptr cannot be freed (the lock held). */
static kva_status why_not_freed(kva_var *v, void *ptr) {
    if (v->inherited) return kva_var_refuse_inherited(); /* not bad input: not counted */
    if (!ptr) return reject(v, kva_fail(KVA_ERR_INVALID, "pointer is NULL"));
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)v->base;
    if (offset >= (uint64_t)v->units << v->align_shift)
        return reject(v, kva_fail(KVA_ERR_BAD_POINTER, "%p is outside the region [%p, %p)", ptr, (void *)v->base,
                                  (void *)(v->base + ((size_t)v->units << v->align_shift))));
    return reject(v, classify_bad_free(v, ptr, offset));
}

KVA_NOINLINE kva_status kva_var_free_rejected(kva_var *v, void *ptr, kva_lock_owner *me) {
    return kva_var_leave(me, why_not_freed(v, ptr));
}
