/*
 * var_stats.c — kva_var_get_stats: a variable-size pool's figures, from the counters every call
 * keeps and the longest free range the policy's structure finds.
 */
#include "var_pool.h"

static uint32_t largest_free(const kva_var *v) {
    const kva_var_range *ranges = v->ranges;
    uint32_t best = 0, from = KVA_NIL;
    switch (v->policy) {
    case KVA_VAR_BEST_FIT:
    case KVA_VAR_WORST_FIT: return v->tail == KVA_NIL ? 0 : kva_var_len(&ranges[v->tail]);
    case KVA_VAR_FIRST_FIT: from = v->head; break;
    case KVA_VAR_TLSF:
        if (v->fl_map == 0) return 0;
        unsigned fl = kva_log2(v->fl_map);
        from = v->bins[fl * KVA_TLSF_SL + kva_log2(v->sl_map[fl])];
        break;
    }
    for (uint32_t at = from; at != KVA_NIL; at = ranges[at].link_next)
        if (kva_var_len(&ranges[at]) > best) best = kva_var_len(&ranges[at]);
    return best;
}

static void get_stats_locked(const kva_var *v, kva_var_stats *out) {
    unsigned shift = v->align_shift;
    kva_var_stats s = {
        .capacity = (size_t)v->units << shift,
        .alignment = (size_t)1 << shift,
        .policy = (uint32_t)v->policy,
        .bytes_used = (size_t)(v->units - v->free_units) << shift,
        .bytes_requested = (size_t)v->requested_bytes,
        .bytes_free = (size_t)v->free_units << shift,
        .largest_free = (size_t)largest_free(v) << shift,
        .free_ranges = v->free_ranges,
        .live_allocations = v->alloc_count - v->free_count,
        .alloc_count = v->alloc_count,
        .free_count = v->free_count,
        .alloc_failures = v->alloc_failures,
        .rejected_calls = v->rejected_calls,
        .metadata_bytes = sizeof *v + v->ranges_bytes,
        .peak_bytes_used = (size_t)(v->units - v->low_free_units) << shift,
    };
    s.internal_waste = s.bytes_used - s.bytes_requested;
    s.fragmentation = s.bytes_free ? 1.0 - (double)s.largest_free / (double)s.bytes_free : 0.0;
    *out = s;
}

kva_status kva_var_get_stats(kva_var *v, kva_var_stats *out) {
    if (!v || !out) return kva_fail(KVA_ERR_INVALID, "variable-size pool or out is NULL");
    kva_var_stats s;
    int token = kva_lock_acquire(&v->lock);
    get_stats_locked(v, &s);
    kva_lock_release(&v->lock, token);
    *out = s;
    return KVA_OK;
}

kva_status kva_var_reset_peaks(kva_var *v) {
    if (!v) return kva_fail(KVA_ERR_INVALID, "variable-size pool is NULL");
    int token = kva_lock_acquire(&v->lock);
    v->low_free_units = v->free_units;
    kva_lock_release(&v->lock, token);
    return KVA_OK;
}
