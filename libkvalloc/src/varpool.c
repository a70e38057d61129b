/*
 * varpool.c — the variable-size pool: create and destroy, alloc and free under each policy,
 * statistics. See varpool.h for the layout, the invariants and the locking.
 */
#include <stdlib.h>

#include "os.h"
#include "varpool.h"

/* ---- the free structures ------------------------------------------------------------------ */

/* Links r after `after` (KVA_NIL: at the head) in the first, best or worst fit list. */
static void list_link_after(kva_var *v, uint32_t r, uint32_t after) {
    kva_var_range *ranges = v->ranges;
    uint32_t next = after == KVA_NIL ? v->head : ranges[after].link_next;
    ranges[r].link_prev = after;
    ranges[r].link_next = next;
    if (after == KVA_NIL)
        v->head = r;
    else
        ranges[after].link_next = r;
    if (next == KVA_NIL)
        v->tail = r;
    else
        ranges[next].link_prev = r;
}

static void list_unlink(kva_var *v, uint32_t r) {
    kva_var_range *ranges = v->ranges;
    uint32_t prev = ranges[r].link_prev, next = ranges[r].link_next;
    if (prev == KVA_NIL)
        v->head = next;
    else
        ranges[prev].link_next = next;
    if (next == KVA_NIL)
        v->tail = prev;
    else
        ranges[next].link_prev = prev;
}

/* First fit: `fresh` takes the place of `old` in the address-ordered list. Used when a split or
 * a merge keeps the list order, so that no walk is needed. */
static void list_replace(kva_var *v, uint32_t old, uint32_t fresh) {
    kva_var_range *ranges = v->ranges;
    uint32_t prev = ranges[old].link_prev, next = ranges[old].link_next;
    ranges[fresh].link_prev = prev;
    ranges[fresh].link_next = next;
    if (prev == KVA_NIL)
        v->head = fresh;
    else
        ranges[prev].link_next = fresh;
    if (next == KVA_NIL)
        v->tail = fresh;
    else
        ranges[next].link_prev = fresh;
}

static void tlsf_push(kva_var *v, uint32_t r) {
    unsigned fl, sl;
    kva_tlsf_class(kva_var_len(&v->ranges[r]), &fl, &sl);
    uint32_t head = v->bins[fl][sl];
    v->ranges[r].link_prev = KVA_NIL;
    v->ranges[r].link_next = head;
    if (head != KVA_NIL) v->ranges[head].link_prev = r;
    v->bins[fl][sl] = r;
    v->sl_map[fl] |= 1u << sl;
    v->fl_map |= 1u << fl;
}

static void tlsf_unlink(kva_var *v, uint32_t r) {
    unsigned fl, sl;
    kva_tlsf_class(kva_var_len(&v->ranges[r]), &fl, &sl);
    uint32_t prev = v->ranges[r].link_prev, next = v->ranges[r].link_next;
    if (prev == KVA_NIL)
        v->bins[fl][sl] = next;
    else
        v->ranges[prev].link_next = next;
    if (next != KVA_NIL) v->ranges[next].link_prev = prev;
    if (v->bins[fl][sl] == KVA_NIL) {
        v->sl_map[fl] &= ~(1u << sl);
        if (v->sl_map[fl] == 0) v->fl_map &= ~(1u << fl);
    }
}

/* The slow half of tlsf_resize: the class changes. */
static KVA_NOINLINE void tlsf_move(kva_var *v, uint32_t old, uint32_t fresh, uint32_t new_len) {
    tlsf_unlink(v, old);
    v->ranges[fresh].length = new_len | KVA_VAR_FREE_BIT;
    tlsf_push(v, fresh);
}

/* The free range `old` of old_len units becomes `fresh` of new_len units (a split leaves its tail,
 * a merge grows it at either end). While the class stays the same, which is the common case for
 * a large free range, fresh takes old's place in the class list and no bitmap changes. */
KVA_INLINE void tlsf_resize(kva_var *v, uint32_t old, uint32_t old_len, uint32_t fresh, uint32_t new_len) {
    kva_var_range *ranges = v->ranges;
    /* Same class: below KVA_TLSF_SL the same length; above, the same bits down to the second
     * level's, which a shift of the XOR tests without computing either class. */
    int same = old_len < KVA_TLSF_SL ? old_len == new_len
                                     : ((old_len ^ new_len) >> (kva_log2(old_len) - KVA_TLSF_SL_LOG2)) == 0;
    if (kva_likely(same)) {
        if (old != fresh) {
            uint32_t prev = ranges[old].link_prev, next = ranges[old].link_next;
            ranges[fresh].link_prev = prev;
            ranges[fresh].link_next = next;
            if (prev == KVA_NIL) {
                unsigned fl, sl;
                kva_tlsf_class(old_len, &fl, &sl);
                v->bins[fl][sl] = fresh;
            } else {
                ranges[prev].link_next = fresh;
            }
            if (next != KVA_NIL) ranges[next].link_prev = fresh;
        }
        ranges[fresh].length = new_len | KVA_VAR_FREE_BIT;
        return;
    }
    tlsf_move(v, old, fresh, new_len);
}

/* The first range of the request's own class that holds it, or KVA_NIL. */
static KVA_NOINLINE uint32_t tlsf_scan_class(const kva_var *v, uint32_t units) {
    unsigned fl, sl;
    kva_tlsf_class(units, &fl, &sl);
    for (uint32_t r = v->bins[fl][sl]; r != KVA_NIL; r = v->ranges[r].link_next)
        if (kva_var_len(&v->ranges[r]) >= units) return r;
    return KVA_NIL;
}

/* TLSF find: round the request up to the next class boundary, so that every range of the class
 * found holds it, then take the first nonempty class at or above: two ctz. When that finds
 * nothing, the request's own class may still hold a range long enough (the rounding skipped
 * it): that class is scanned, on the failure path only, so TLSF fails no more often than an
 * exact fit would. */
static uint32_t tlsf_find(const kva_var *v, uint32_t units) {
    uint64_t rounded = units;
    if (units >= KVA_TLSF_SL) rounded += ((uint64_t)1 << (kva_log2(units) - KVA_TLSF_SL_LOG2)) - 1;
    if (rounded <= KVA_VAR_MAX_UNITS) {
        unsigned fl, sl;
        kva_tlsf_class((uint32_t)rounded, &fl, &sl);
        uint32_t sl_bits = v->sl_map[fl] & (~0u << sl);
        if (sl_bits == 0) {
            uint32_t fl_bits = fl + 1 < 32 ? v->fl_map & (~0u << (fl + 1)) : 0;
            if (fl_bits != 0) {
                fl = (unsigned)__builtin_ctz(fl_bits);
                sl_bits = v->sl_map[fl];
            }
        }
        if (kva_likely(sl_bits != 0)) return v->bins[fl][__builtin_ctz(sl_bits)];
    }
    return tlsf_scan_class(v, units);
}

/* Adds the free range r (its length already set) to the policy's structure. */
static void free_insert(kva_var *v, uint32_t r) {
    kva_var_range *ranges = v->ranges;
    uint32_t length = kva_var_len(&ranges[r]);
    uint32_t after = KVA_NIL;
    switch (v->policy) {
    case KVA_VAR_TLSF:
        tlsf_push(v, r);
        return;
    case KVA_VAR_FIRST_FIT:
        /* The free range before r in address order is the nearest free head behind it. */
        for (uint32_t at = ranges[r].prev; at != KVA_NIL; at = ranges[at].prev)
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
        while (after != KVA_NIL && (kva_var_len(&ranges[after]) > length ||
                                    (kva_var_len(&ranges[after]) == length && after > r)))
            after = ranges[after].link_prev;
        break;
    }
    list_link_after(v, r, after);
}

static void free_remove(kva_var *v, uint32_t r) {
    if (v->policy == KVA_VAR_TLSF)
        tlsf_unlink(v, r);
    else
        list_unlink(v, r);
}

/* A free range of at least `units`, or KVA_NIL. */
static uint32_t free_find(const kva_var *v, uint32_t units) {
    const kva_var_range *ranges = v->ranges;
    switch (v->policy) {
    case KVA_VAR_TLSF:
        return tlsf_find(v, units);
    case KVA_VAR_FIRST_FIT:
    case KVA_VAR_BEST_FIT: /* the first that fits: lowest address, or shortest */
        for (uint32_t at = v->head; at != KVA_NIL; at = ranges[at].link_next)
            if (kva_var_len(&ranges[at]) >= units) return at;
        return KVA_NIL;
    case KVA_VAR_WORST_FIT:
        return v->tail != KVA_NIL && kva_var_len(&ranges[v->tail]) >= units ? v->tail : KVA_NIL;
    }
    return KVA_NIL;
}

/* ---- create and destroy ------------------------------------------------------------------- */

void kva_var_config_init(kva_var_config *cfg) {
    if (!cfg) return;
    *cfg = (kva_var_config){.capacity = (size_t)64 << 20, .alignment = 256, .policy = KVA_VAR_TLSF,
                            .pages = KVA_PAGES_THP};
}

static kva_status validate(const kva_var_config *cfg) {
    if (!cfg) return kva_fail(KVA_ERR_INVALID, "config is NULL");
    if (!kva_is_pow2(cfg->alignment) || cfg->alignment < 16 || cfg->alignment > ((size_t)1 << 30))
        return kva_fail(KVA_ERR_INVALID, "alignment %zu is not a power of two in [16 B, 1 GiB]", cfg->alignment);
    if (cfg->capacity < cfg->alignment)
        return kva_fail(KVA_ERR_INVALID, "capacity %zu is less than one alignment unit (%zu)", cfg->capacity,
                        cfg->alignment);
    if (cfg->capacity / cfg->alignment > KVA_VAR_MAX_UNITS)
        return kva_fail(KVA_ERR_INVALID, "capacity %zu is 2^31 alignment units or more; raise the alignment",
                        cfg->capacity);
    if ((unsigned)cfg->policy > KVA_VAR_WORST_FIT) return kva_fail(KVA_ERR_INVALID, "unknown policy %d", (int)cfg->policy);
    if ((unsigned)cfg->pages > KVA_PAGES_SMALL) return kva_fail(KVA_ERR_INVALID, "unknown page mode %d", (int)cfg->pages);
    return KVA_OK;
}

/* A host pool whose largest block holds `bytes`: the next power of two above it. */
static kva_status create_own_pool(const kva_var_config *cfg, size_t bytes, kva_pool **out) {
    kva_config pc;
    kva_config_init(&pc);
    size_t capacity = (size_t)1 << 20;
    while (capacity < bytes) capacity <<= 1;
    pc.capacity = capacity;
    pc.pages = cfg->pages;
    return kva_pool_create(&pc, out);
}

kva_status kva_var_create(const kva_var_config *cfg, kva_pool *backing, kva_var **out) {
    kva_status st = validate(cfg);
    if (st != KVA_OK) return st;
    if (!out) return kva_fail(KVA_ERR_INVALID, "out is NULL");
    kva_var *v = calloc(1, sizeof *v);
    if (!v) return kva_fail(KVA_ERR_NOMEM, "no host memory for the variable-size pool descriptor");
    v->align_shift = kva_log2(cfg->alignment);
    v->units = (uint32_t)(cfg->capacity >> v->align_shift);
    v->policy = cfg->policy;
    size_t bytes = (size_t)v->units << v->align_shift;
    v->bytes = bytes;
    v->align_mask = cfg->alignment - 1;

    v->ranges_bytes = (size_t)v->units * sizeof(kva_var_range);
    void *ranges;
    st = kva_os_map_metadata(v->ranges_bytes, &ranges);
    if (st != KVA_OK) goto fail_descriptor;
    v->ranges = ranges;

    v->pool = backing;
    if (!backing) {
        st = create_own_pool(cfg, bytes, &v->pool);
        if (st != KVA_OK) goto fail_ranges;
        v->owns_pool = 1;
    }
    void *base;
    st = kva_alloc_exact(v->pool, bytes, &base);
    if (st != KVA_OK) goto fail_pool;
    v->base = base;

    v->head = v->tail = KVA_NIL;
    for (unsigned fl = 0; fl < KVA_TLSF_FL; fl++)
        for (unsigned sl = 0; sl < KVA_TLSF_SL; sl++) v->bins[fl][sl] = KVA_NIL;
    v->ranges[0] = (kva_var_range){.length = v->units | KVA_VAR_FREE_BIT, .prev = KVA_NIL};
    free_insert(v, 0);
    v->free_units = v->units;
    v->free_ranges = 1;
    *out = v;
    return KVA_OK;

fail_pool:
    if (v->owns_pool) kva_pool_destroy(v->pool);
fail_ranges:
    kva_os_unmap(v->ranges, v->ranges_bytes);
fail_descriptor:
    free(v);
    return st;
}

void kva_var_destroy(kva_var *v) {
    if (!v) return;
    /* No other call on this pool may be running (documented): the lock is not taken. */
    if (v->owns_pool)
        kva_pool_destroy(v->pool);
    else
        kva_free(v->pool, v->base);
    kva_os_unmap(v->ranges, v->ranges_bytes);
    free(v);
}

/* ---- alloc and free ----------------------------------------------------------------------- */

/* Counts a refused call (the lock held) and returns its status. */
static kva_status reject(kva_var *v, kva_status status) {
    v->rejected_calls++;
    return status;
}

/* The arguments are decided by fields fixed at creation; only the count takes the lock. */
static KVA_NOINLINE kva_status alloc_rejected(kva_var *v, size_t size, void **out) {
    if (!v) return kva_fail(KVA_ERR_INVALID, "variable-size pool is NULL");
    kva_status st = !out ? kva_fail(KVA_ERR_INVALID, "out is NULL")
                    : size == 0 ? kva_fail(KVA_ERR_INVALID, "size 0")
                                : kva_fail(KVA_ERR_INVALID, "size %zu exceeds the capacity (%zu)", size,
                                           (size_t)v->units << v->align_shift);
    int token = kva_lock_acquire(&v->lock);
    reject(v, st);
    kva_lock_release(&v->lock, token);
    return st;
}

static kva_status alloc_locked(kva_var *v, size_t size, void **out) {
    uint32_t units = (uint32_t)((size + v->align_mask) >> v->align_shift);
    uint32_t at = free_find(v, units);
    if (kva_unlikely(at == KVA_NIL)) {
        v->alloc_failures++;
        return kva_fail(KVA_ERR_NOMEM, "no free range of %u units of %zu B for %zu B (%llu units free)", units,
                        (size_t)1 << v->align_shift, size, (unsigned long long)v->free_units);
    }
    kva_var_range *ranges = v->ranges;
    uint32_t length = kva_var_len(&ranges[at]);
    if (length > units) {
        /* Split: the tail stays free. In address order it takes the place of the whole. */
        uint32_t rest = at + units, after = at + length;
        ranges[rest].prev = at;
        if (after < v->units) ranges[after].prev = rest;
        if (kva_likely(v->policy == KVA_VAR_TLSF)) {
            tlsf_resize(v, at, length, rest, length - units);
        } else {
            if (v->policy == KVA_VAR_FIRST_FIT)
                list_replace(v, at, rest);
            else
                free_remove(v, at);
            ranges[rest].length = (length - units) | KVA_VAR_FREE_BIT;
            if (v->policy != KVA_VAR_FIRST_FIT) free_insert(v, rest);
        }
    } else {
        free_remove(v, at);
        v->free_ranges--;
    }
    ranges[at].length = units;
    ranges[at].link_prev = (uint32_t)size;
    ranges[at].link_next = (uint32_t)((uint64_t)size >> 32);
    v->free_units -= units;
    v->requested_bytes += size;
    v->alloc_count++;
    *out = v->base + ((size_t)at << v->align_shift);
    return KVA_OK;
}

kva_status kva_var_alloc(kva_var *v, size_t size, void **out) {
    /* One test for the arguments: size - 1 wraps for 0. */
    if (kva_unlikely(!v || !out || size - 1 >= v->bytes)) return alloc_rejected(v, size, out);
    int token = kva_lock_acquire(&v->lock);
    kva_status st = alloc_locked(v, size, out);
    kva_lock_release(&v->lock, token);
    return st;
}

/* Why a unit that is not a used head cannot be freed: the range that holds it (the nearest head
 * at or before it, since every record inside a range is zero) is free or live. */
static kva_status classify_bad_free(const kva_var *v, const void *ptr, uint64_t offset) {
    uint32_t at = (uint32_t)(offset >> v->align_shift);
    while (at > 0 && v->ranges[at].length == 0) at--;
    uint64_t head = (uint64_t)at << v->align_shift;
    if (kva_var_is_free(&v->ranges[at]))
        return kva_fail(KVA_ERR_DOUBLE_FREE, "%p (offset %llu) lies in the free range at offset %llu", ptr,
                        (unsigned long long)offset, (unsigned long long)head);
    return kva_fail(KVA_ERR_BAD_POINTER, "%p (offset %llu) is inside the live range at offset %llu", ptr,
                    (unsigned long long)offset, (unsigned long long)head);
}

/* Frees the used range at `at`, merging it with free neighbours. */
static void release(kva_var *v, uint32_t at) {
    kva_var_range *ranges = v->ranges;
    uint32_t length = ranges[at].length;
    v->free_units += length;
    v->requested_bytes -= kva_var_requested(&ranges[at]);
    uint32_t next = at + length, prev = ranges[at].prev;
    int next_free = next < v->units && kva_var_is_free(&ranges[next]);
    int prev_free = prev != KVA_NIL && kva_var_is_free(&ranges[prev]);
    uint32_t start = at, total = length;
    if (kva_likely(v->policy == KVA_VAR_TLSF)) {
        /* The merged range keeps the place of a free neighbour when its class does not change. */
        if (prev_free) {
            uint32_t prev_len = kva_var_len(&ranges[prev]);
            if (next_free) {
                total += kva_var_len(&ranges[next]);
                tlsf_unlink(v, next);
                ranges[next] = (kva_var_range){0};
            }
            ranges[at] = (kva_var_range){0};
            start = prev;
            total += prev_len;
            tlsf_resize(v, prev, prev_len, prev, total);
        } else if (next_free) {
            uint32_t next_len = kva_var_len(&ranges[next]);
            total += next_len;
            tlsf_resize(v, next, next_len, at, total);
            ranges[next] = (kva_var_range){0};
        } else {
            ranges[at].length = length | KVA_VAR_FREE_BIT;
            tlsf_push(v, at);
        }
    } else if (v->policy == KVA_VAR_FIRST_FIT) {
        /* Address order survives every merge: the merged range takes the place of the free
         * neighbour before it, or else of the one after it; only a lone range walks. */
        if (next_free) {
            total += kva_var_len(&ranges[next]);
            if (prev_free)
                list_unlink(v, next);
            else
                list_replace(v, next, at);
            ranges[next] = (kva_var_range){0};
        }
        if (prev_free) {
            total += kva_var_len(&ranges[prev]);
            ranges[at] = (kva_var_range){0};
            start = prev;
        }
        ranges[start].length = total | KVA_VAR_FREE_BIT;
        if (!next_free && !prev_free) free_insert(v, start);
    } else {
        if (next_free) {
            free_remove(v, next);
            total += kva_var_len(&ranges[next]);
            ranges[next] = (kva_var_range){0};
        }
        if (prev_free) {
            free_remove(v, prev);
            total += kva_var_len(&ranges[prev]);
            ranges[at] = (kva_var_range){0};
            start = prev;
        }
        ranges[start].length = total | KVA_VAR_FREE_BIT;
        free_insert(v, start);
    }
    if (start + total < v->units) ranges[start + total].prev = start;
    v->free_ranges = v->free_ranges + 1 - (uint64_t)next_free - (uint64_t)prev_free;
    v->free_count++;
}

/* Why ptr cannot be freed (the lock held). */
static KVA_NOINLINE kva_status free_rejected(kva_var *v, void *ptr) {
    if (!ptr) return reject(v, kva_fail(KVA_ERR_INVALID, "pointer is NULL"));
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)v->base;
    if (offset >= (uint64_t)v->units << v->align_shift)
        return reject(v, kva_fail(KVA_ERR_BAD_POINTER, "%p is outside the region [%p, %p)", ptr, (void *)v->base,
                                  (void *)(v->base + ((size_t)v->units << v->align_shift))));
    return reject(v, classify_bad_free(v, ptr, offset));
}

static kva_status free_locked(kva_var *v, void *ptr) {
    /* One test for everything that is not the start of a live range: NULL falls outside the
     * region (base is never 0), and a used head has a length in [1, KVA_VAR_MAX_UNITS], so one
     * compare excludes free ranges (free bit set) and records inside ranges (0). */
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)v->base;
    uint32_t at = (uint32_t)(offset >> v->align_shift);
    if (kva_likely(ptr != NULL && offset < v->bytes && (offset & v->align_mask) == 0 &&
                   v->ranges[at].length - 1u < KVA_VAR_MAX_UNITS)) {
        release(v, at);
        return KVA_OK;
    }
    return free_rejected(v, ptr);
}

kva_status kva_var_free(kva_var *v, void *ptr) {
    if (kva_unlikely(v == NULL)) return kva_fail(KVA_ERR_INVALID, "variable-size pool is NULL");
    int token = kva_lock_acquire(&v->lock);
    kva_status st = free_locked(v, ptr);
    kva_lock_release(&v->lock, token);
    return st;
}

size_t kva_var_usable_size(kva_var *v, const void *ptr) {
    if (!v || !ptr) return 0;
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)v->base;
    if (offset >= (uint64_t)v->units << v->align_shift || (offset & (((uint64_t)1 << v->align_shift) - 1))) return 0;
    int token = kva_lock_acquire(&v->lock);
    const kva_var_range *r = &v->ranges[offset >> v->align_shift];
    size_t usable = r->length == 0 || kva_var_is_free(r) ? 0 : (size_t)r->length << v->align_shift;
    kva_lock_release(&v->lock, token);
    return usable;
}

kva_status kva_var_base(kva_var *v, void **base) {
    /* base is fixed at creation: no lock. */
    if (!v || !base) return kva_fail(KVA_ERR_INVALID, "variable-size pool or base is NULL");
    *base = v->base;
    return KVA_OK;
}

/* ---- statistics --------------------------------------------------------------------------- */

static uint32_t largest_free(const kva_var *v) {
    const kva_var_range *ranges = v->ranges;
    uint32_t best = 0, from = KVA_NIL;
    switch (v->policy) {
    case KVA_VAR_BEST_FIT:
    case KVA_VAR_WORST_FIT:
        return v->tail == KVA_NIL ? 0 : kva_var_len(&ranges[v->tail]);
    case KVA_VAR_FIRST_FIT:
        from = v->head;
        break;
    case KVA_VAR_TLSF:
        if (v->fl_map == 0) return 0;
        unsigned fl = kva_log2(v->fl_map);
        from = v->bins[fl][kva_log2(v->sl_map[fl])];
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

size_t kva_var_struct_size(int which) {
    switch (which) {
    case 1:
        return sizeof(kva_var_config);
    case 2:
        return sizeof(kva_var_stats);
    default:
        return 0;
    }
}
