/*
 * var_tlsf.c — the variable-size pool: create and destroy, alloc and free under each policy,
 * statistics. See var_pool.h for the layout, the invariants, the placement inside the chosen
 * free range (best fit and TLSF carve a request beside the shorter neighbour of the range,
 * carve_high) and the locking.
 */
#include <stdlib.h>

#include "config.h"
#include "os.h"
#include "pool_own.h"
#include "var_pool.h"

/* ---- the free structures ------------------------------------------------------------------ */

/* The range after the one at `start` of `length` units (the sentinel after the last) names it as
 * prev. */
KVA_INLINE void link_follower(kva_var *v, uint32_t start, uint32_t length) { v->ranges[start + length].prev = start; }

/* Splits the free range at `at` of `length` units after its first `units`: the tail becomes a
 * free range of its own, linked both ways in address order, in no free structure yet. Returns
 * the tail. `ranges` is v->ranges, which a caller on the hot path already holds. */
KVA_INLINE uint32_t split_tail(kva_var_range *ranges, uint32_t at, uint32_t length, uint32_t units) {
    uint32_t rest = at + units;
    ranges[rest].prev = at;
    ranges[rest].length = (length - units) | KVA_VAR_FREE_BIT;
    ranges[at + length].prev = rest; /* link_follower(v, rest, length - units) */
    return rest;
}

/* The other split: the free range at `at` of `length` units gives its last `units` and keeps the
 * rest, shorter, under the same head (its free structure is the caller's to fix). Returns the
 * head of the part given, linked both ways, not yet marked used. */
KVA_INLINE uint32_t split_front(kva_var_range *ranges, uint32_t at, uint32_t length, uint32_t units) {
    uint32_t given = at + length - units;
    ranges[given].prev = at;
    ranges[at].length = (length - units) | KVA_VAR_FREE_BIT;
    ranges[at + length].prev = given;
    return given;
}

/* Which end of the free range at `at` of `length` units best fit and TLSF carve `units` from
 * (the rule, its reason and its measurements: var_pool.h, "Placement"): the end beside the
 * shorter of the range's two neighbours, a pool edge counting as shorter than any range, so that
 * the remainder stays beside the longer neighbour; the low end on a tie, when the range is
 * taken whole, and for a request below KVA_VAR_CARVE_MIN units. Both neighbours are used (V2),
 * so their length fields hold no free bit, and a pool edge is the sentinel, whose length is 0:
 * the edge below the first range ties or loses, so that range is carved low, and the edge above
 * the last one wins. Returns nonzero for the high end. */
KVA_INLINE int carve_high(const kva_var_range *ranges, uint32_t at, uint32_t length, uint32_t units) {
    if (units < KVA_VAR_CARVE_MIN || length == units) return 0;
    return ranges[at + length].length < ranges[ranges[at].prev].length;
}

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

/* How every locked path of alloc and free ends. A caller that entered by the lock's bias passes
 * its flag (me) and the path leaves the lock; one that took the plain lock passes NULL and
 * releases it itself. The slow parts of a path are tail calls that take `me` and end here in
 * their turn, so the fast paths call nothing, and need no callee-saved registers. */
KVA_INLINE kva_status leave(kva_lock_owner *me, kva_status st) {
    if (me) kva_lock_leave_biased(me);
    return st;
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
    return leave(me, KVA_OK);
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
 * changes. Ends the locked path (leave). */
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
    return leave(me, KVA_OK);
}

/* The first range of the request's own class that holds it, or KVA_NIL. */
static KVA_NOINLINE uint32_t tlsf_scan_class(const kva_var *v, uint32_t units) {
    for (uint32_t r = v->bins[kva_tlsf_index(units)]; r != KVA_NIL; r = v->ranges[r].link_next)
        if (kva_var_len(&v->ranges[r]) >= units) return r;
    return KVA_NIL;
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
        while (after != KVA_NIL && (kva_var_len(&ranges[after]) > length ||
                                    (kva_var_len(&ranges[after]) == length && after > r)))
            after = ranges[after].link_prev;
        break;
    }
    list_link_after(v, r, after);
}


/* First, best and worst fit: a free range of at least `units`, or KVA_NIL. */
static uint32_t free_find(const kva_var *v, uint32_t units) {
    const kva_var_range *ranges = v->ranges;
    switch (v->policy) {
    case KVA_VAR_TLSF: /* tlsf_alloc searches itself */
        return KVA_NIL;
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

/* A host pool whose largest block holds `bytes`: the next power of two above it, in blocks of
 * the default size or larger where a pool's u32 block indices need it (from 16 TiB up, where
 * 4 KiB blocks number 2^32): the caller never wrote that pool's config, so it must not be
 * refused for it. */
static kva_status create_own_pool(const kva_var_config *cfg, size_t bytes, kva_pool **out) {
    kva_config pc;
    kva_config_init(&pc);
    size_t capacity = (size_t)1 << 20;
    while (capacity < bytes) capacity <<= 1;
    while ((capacity >> kva_log2(pc.min_block)) >= KVA_NIL && pc.min_block < KVA_MIN_BLOCK_MAX) pc.min_block <<= 1;
    pc.capacity = capacity;
    pc.pages = cfg->pages;
    return kva_pool_create_own(&pc, out);
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
    v->alignment = cfg->alignment;

    v->ranges_bytes = ((size_t)v->units + 1) * sizeof(kva_var_range); /* and the sentinel */
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
    if (st == KVA_ERR_INVALID) /* the request is valid; the pool's largest block is too small */
        st = kva_fail(KVA_ERR_NOMEM, "the backing pool cannot hold %zu bytes in one range", bytes);
    if (st != KVA_OK) goto fail_pool;
    if ((uintptr_t)base & v->align_mask) { /* a checked pool: 16 B past its red zone */
        kva_free(v->pool, base);
        st = kva_fail(KVA_ERR_INVALID, "the backing pool aligns ranges to less than %zu bytes (a checked pool: 16)",
                      cfg->alignment);
        goto fail_pool;
    }
    v->base = base;

    v->head = v->tail = KVA_NIL;
    for (unsigned cls = 0; cls < KVA_TLSF_FL * KVA_TLSF_SL; cls++) v->bins[cls] = KVA_NIL;
    v->ranges[0] = (kva_var_range){.length = v->units | KVA_VAR_FREE_BIT, .prev = v->units};
    v->ranges[v->units] = (kva_var_range){.prev = 0}; /* the sentinel */
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

/* Marks the range whose head record is r (no longer in any free structure) used for `size`
 * bytes. */
KVA_INLINE void mark_used(kva_var *v, kva_var_range *r, uint32_t units, size_t size) {
    r->length = units;
    r->link_prev = (uint32_t)size;
    r->link_next = (uint32_t)((uint64_t)size >> 32);
    v->free_units -= units;
    v->requested_bytes += size;
    v->alloc_count++;
}

static KVA_NOINLINE kva_status alloc_failed(kva_var *v, size_t size, uint32_t units, kva_lock_owner *me) {
    v->alloc_failures++;
    return leave(me, kva_fail(KVA_ERR_NOMEM, "no free range of %u units of %zu B for %zu B (%llu units free)", units,
                              (size_t)1 << v->align_shift, size, (unsigned long long)v->free_units));
}

/* First, best and worst fit. */
static KVA_NOINLINE kva_status list_alloc(kva_var *v, size_t size, void **out, kva_lock_owner *me) {
    uint32_t units = (uint32_t)((size + v->align_mask) >> v->align_shift);
    uint32_t at = free_find(v, units);
    if (kva_unlikely(at == KVA_NIL)) return alloc_failed(v, size, units, me);
    kva_var_range *ranges = v->ranges;
    uint32_t length = kva_var_len(&ranges[at]);
    if (v->policy == KVA_VAR_BEST_FIT && carve_high(ranges, at, length, units)) {
        /* The front stays free under its head, shorter: it moves down the length order. */
        list_unlink(v, at);
        uint32_t given = split_front(ranges, at, length, units);
        free_insert(v, at);
        at = given;
    } else if (length > units) {
        /* Split: the tail stays free. In address order it takes the place of the whole. First
         * and worst fit always carve the low end: first fit's address order is what it is
         * measured by, and the rule would undo it (var_pool.h, "Placement"). */
        uint32_t rest = split_tail(ranges, at, length, units);
        if (v->policy == KVA_VAR_FIRST_FIT) {
            list_replace(v, at, rest);
        } else {
            list_unlink(v, at);
            free_insert(v, rest);
        }
    } else {
        list_unlink(v, at);
        v->free_ranges--;
    }
    mark_used(v, &ranges[at], units, size);
    *out = v->base + ((size_t)at << v->align_shift);
    return leave(me, KVA_OK);
}

/* Takes `units` from the free range at `at`, wherever it sits in its class, at the end the
 * placement rule picks (carve_high): what is left goes back to its own class. Returns the head
 * of the part taken. */
static uint32_t tlsf_take(kva_var *v, uint32_t at, uint32_t units) {
    kva_var_range *ranges = v->ranges;
    uint32_t length = kva_var_len(&ranges[at]);
    tlsf_unlink(v, at);
    if (length == units) {
        v->free_ranges--;
        return at;
    }
    if (carve_high(ranges, at, length, units)) {
        uint32_t given = split_front(ranges, at, length, units);
        tlsf_push(v, at);
        return given;
    }
    tlsf_push(v, split_tail(ranges, at, length, units));
    return at;
}

/* TLSF when the two-ctz search finds nothing: the request's own class may still hold a range
 * long enough beyond its head (the search skipped it). */
static KVA_NOINLINE kva_status tlsf_alloc_slow(kva_var *v, size_t size, void **out, uint32_t units,
                                                kva_lock_owner *me) {
    uint32_t at = tlsf_scan_class(v, units);
    if (at == KVA_NIL) return alloc_failed(v, size, units, me);
    at = tlsf_take(v, at, units);
    mark_used(v, &v->ranges[at], units, size);
    *out = v->base + ((size_t)at << v->align_shift);
    return leave(me, KVA_OK);
}

/* kva_tlsf_floors (var_pool.h), built at compile time: the shortest length class (fl, sl) holds is
 * sl below KVA_TLSF_SL, else (KVA_TLSF_SL + sl) << (fl - 1). */
#define FLOOR_SHIFT(i) ((i) < KVA_TLSF_SL ? 0 : (i) / KVA_TLSF_SL - 1) /* never negative, even unused */
#define FLOOR_OF(i) ((uint32_t)((i) < KVA_TLSF_SL ? (i) : (KVA_TLSF_SL + (i) % KVA_TLSF_SL) << FLOOR_SHIFT(i)))
#define FLOORS_4(i) FLOOR_OF(i), FLOOR_OF((i) + 1), FLOOR_OF((i) + 2), FLOOR_OF((i) + 3)
#define FLOORS_32(i) FLOORS_4(i), FLOORS_4((i) + 4), FLOORS_4((i) + 8), FLOORS_4((i) + 12), FLOORS_4((i) + 16), \
                     FLOORS_4((i) + 20), FLOORS_4((i) + 24), FLOORS_4((i) + 28)
#define FLOORS_288(i) FLOORS_32(i), FLOORS_32((i) + 32), FLOORS_32((i) + 64), FLOORS_32((i) + 96), \
                      FLOORS_32((i) + 128), FLOORS_32((i) + 160), FLOORS_32((i) + 192), FLOORS_32((i) + 224), \
                      FLOORS_32((i) + 256)
_Static_assert(KVA_TLSF_FL * KVA_TLSF_SL == 3 * 288, "kva_tlsf_floors lists 3 x 288 classes");
const uint32_t kva_tlsf_floors[KVA_TLSF_FL * KVA_TLSF_SL] = {FLOORS_288(0), FLOORS_288(288), FLOORS_288(576)};
#undef FLOOR_SHIFT
#undef FLOOR_OF
#undef FLOORS_4
#undef FLOORS_32
#undef FLOORS_288

/* Removes the head of class (fl, sl), whose successor is `next`. */
KVA_INLINE void tlsf_pop_head(kva_var *v, unsigned fl, unsigned sl, uint32_t next) {
    v->bins[fl * KVA_TLSF_SL + sl] = next;
    if (next != KVA_NIL)
        v->ranges[next].link_prev = KVA_NIL;
    else if ((v->sl_map[fl] &= ~(1u << sl)) == 0)
        v->fl_map &= ~(1u << fl);
}

/* A split's tail falls below its class: the head of (fl, sl), already used, leaves the class and
 * the tail `rest` (its length set) joins its own. */
static KVA_NOINLINE kva_status tlsf_requeue(kva_var *v, unsigned fl, unsigned sl, uint32_t next, uint32_t rest,
                                             kva_lock_owner *me) {
    tlsf_pop_head(v, fl, sl, next);
    tlsf_push(v, rest);
    return leave(me, KVA_OK);
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
 * end (carve_high): the front stays the class's head, shorter, unless that takes it below the
 * class's floor. The class and the request's units are derived again rather than passed, so that
 * the call from tlsf_alloc stays a tail call (arguments in registers). */
static KVA_NOINLINE kva_status tlsf_alloc_high(kva_var *v, uint32_t at, size_t size, void **out, kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    uint32_t units = (uint32_t)((size + v->align_mask) >> v->align_shift);
    uint32_t length = kva_var_len(&ranges[at]), next = ranges[at].link_next;
    unsigned fl, sl;
    kva_tlsf_class(length, &fl, &sl);
    uint32_t given = split_front(ranges, at, length, units);
    mark_used(v, &ranges[given], units, size);
    *out = v->base + ((size_t)given << v->align_shift);
    if (length - units < kva_tlsf_floors[fl * KVA_TLSF_SL + sl]) {
        tlsf_pop_head(v, fl, sl, next);
        tlsf_push(v, at);
    }
    return leave(me, KVA_OK);
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
 * (carve_high, tlsf_alloc_high); KVA_VAR_CARVE_MIN is KVA_TLSF_SL, so a shorter one, on its own
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
        if (carve_high(ranges, at, kva_var_len(&ranges[at]), units)) return tlsf_alloc_high(v, at, size, out, me);
    }
    /* The range is marked used and handed out first, so that little stays live across the
     * list work that follows. */
    kva_var_range *r = &ranges[at];
    uint32_t length = kva_var_len(r), next = r->link_next;
    mark_used(v, r, units, size);
    *out = v->base + ((size_t)at << v->align_shift);
    if (length > units) {
        uint32_t rest = split_tail(ranges, at, length, units);
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
    return leave(me, KVA_OK);
}

/* Every policy's allocation, with the lock held. */
static KVA_NOINLINE kva_status alloc_any(kva_var *v, size_t size, void **out, kva_lock_owner *me) {
    if (v->policy == KVA_VAR_TLSF) return tlsf_alloc_any(v, size, out, me);
    return list_alloc(v, size, out, me);
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
    mark_used(v, r, units, size);
    uint32_t rest = at + units;
    kva_var_range *t = r + units;
    t->length = rest_len | KVA_VAR_FREE_BIT;
    t->prev = at;
    t->link_prev = KVA_NIL;
    t->link_next = next;
    r[length].prev = rest;
    if (next != KVA_NIL) v->ranges[next].link_prev = rest; /* below the head as often as above */
    v->bins[cls] = rest;
    return leave(me, KVA_OK);
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
    if (kva_unlikely(!v || !out || size - 1 >= v->bytes)) return alloc_rejected(v, size, out);
    kva_lock_owner *me = kva_lock_enter_biased(&v->lock);
    if (kva_unlikely(me == NULL)) return alloc_plain(v, size, out);
    return alloc_locked(v, size, out, me);
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

/* A freed range with free ranges on both sides: the three become the previous one. */
static KVA_NOINLINE kva_status tlsf_merge_three(kva_var *v, uint32_t at, uint32_t prev, uint32_t next,
                                                kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    uint32_t prev_len = kva_var_len(&ranges[prev]);
    uint32_t total = prev_len + ranges[at].length + kva_var_len(&ranges[next]);
    tlsf_unlink(v, next);
    ranges[next] = (kva_var_range){0};
    ranges[at] = (kva_var_range){0};
    link_follower(v, prev, total);
    v->free_ranges--;
    return tlsf_resize(v, prev, prev_len, prev, total, me);
}

/* A freed range with no free neighbour joins its class. */
static KVA_NOINLINE kva_status tlsf_insert(kva_var *v, uint32_t at, kva_lock_owner *me) {
    v->ranges[at].length |= KVA_VAR_FREE_BIT; /* the range after it still names it as prev */
    v->free_ranges++;
    tlsf_push(v, at);
    return leave(me, KVA_OK);
}

/* TLSF free of the used range at `at` whose previous range is not free: it merges with the next
 * one when that is free (the merged range takes the next one's place in its class when the class
 * does not change, tlsf_resize), else joins its class alone. */
static KVA_NOINLINE kva_status tlsf_release_forward(kva_var *v, uint32_t at, kva_lock_owner *me) {
    kva_var_range *ranges = v->ranges;
    uint32_t length = ranges[at].length, next = at + length;
    if (kva_var_is_free(&ranges[next])) {
        uint32_t next_len = kva_var_len(&ranges[next]), total = length + next_len;
        link_follower(v, at, total);
        return tlsf_resize(v, next, next_len, at, total, me);
    }
    return tlsf_insert(v, at, me);
}

/* TLSF free of the used range at `at`, merging it with free neighbours; inlined into
 * kva_var_free. The common case stays here: the range before is free and the one after is not
 * (frees in the order of allocation), so the previous range grows in place and keeps its place
 * in its class unless its class changes (tlsf_move). Ends the locked path (leave). */
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
    ranges[next].prev = prev; /* link_follower, with `next` known */
    if (kva_unlikely(!tlsf_same_class(prev_len, total))) return tlsf_move(v, prev, prev_len, prev, total, me);
    ranges[prev].length = total | KVA_VAR_FREE_BIT;
    return leave(me, KVA_OK);
}

/* First, best and worst fit: frees the used range at `at`, merging it with free neighbours. */
static KVA_NOINLINE kva_status list_release(kva_var *v, uint32_t at, kva_lock_owner *me) {
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
        free_insert(v, start);
    }
    link_follower(v, start, total);
    v->free_ranges = v->free_ranges + 1 - (uint64_t)next_free - (uint64_t)prev_free;
    v->free_count++;
    return leave(me, KVA_OK);
}

/* Why ptr cannot be freed (the lock held). */
static kva_status why_not_freed(kva_var *v, void *ptr) {
    if (!ptr) return reject(v, kva_fail(KVA_ERR_INVALID, "pointer is NULL"));
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)v->base;
    if (offset >= (uint64_t)v->units << v->align_shift)
        return reject(v, kva_fail(KVA_ERR_BAD_POINTER, "%p is outside the region [%p, %p)", ptr, (void *)v->base,
                                  (void *)(v->base + ((size_t)v->units << v->align_shift))));
    return reject(v, classify_bad_free(v, ptr, offset));
}

static KVA_NOINLINE kva_status free_rejected(kva_var *v, void *ptr, kva_lock_owner *me) {
    return leave(me, why_not_freed(v, ptr));
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
        return list_release(v, at, me);
    }
    return free_rejected(v, ptr, me);
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
