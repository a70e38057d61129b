/*
 * fuzz_var.c — libFuzzer harness for the variable-size pools: the input bytes choose a policy
 * (first, best, worst fit or TLSF), an alignment and a capacity, then a sequence of
 * allocations, frees (good, double, interior, foreign, NULL) and size queries, run against a
 * shadow model of what is live. kva_var_check after every operation is the oracle, with the
 * model: a broken invariant, a wrong status, an overlap, a misaligned or overwritten range, a
 * refused allocation while a free range could hold it, or statistics that disagree with the
 * model abort, which libFuzzer reports as a crash with the input that caused it.
 *
 * The first byte's low two bits are the policy; its bit 2 chooses the backing. Clear (every seed
 * written before the backing mode was), the variable-size pool makes its own host pool. Set, it
 * lives in a kva_pool the harness creates (two more bytes vary its capacity and min_block, and
 * make it checked, with red zones, sometimes), because a variable-size pool promises to manage
 * any backing the other pools do: the harness then also allocates and frees ordinary objects of
 * that pool between the VarPool's operations, and after each operation expects kva_check of the
 * backing to pass, its bytes in use to be the objects' and the VarPool's region's exactly, and no
 * object to overlap the region (the VarPool's ranges lie inside the region, checked apart), so
 * neither side can write into the other. After kva_var_destroy the region must be free in the
 * backing again: its bytes in use are the objects' alone, and once they are freed too the
 * backing is as it was created, and a VarPool created over it again behaves as over a new one.
 *
 * Build and run: make fuzz (clang's -fsanitize=fuzzer,address,undefined).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"
#include "kvalloc.h"

#define MAX_LIVE 256
#define MAX_OBJECTS 64
#define REDZONE 16 /* bytes a checked pool keeps before each allocation (kva_config.checked) */

typedef struct live_range {
    unsigned char *ptr;
    size_t size, rounded;
    unsigned char stamp;
} live_range;

/* An ordinary allocation of the backing pool, beside the VarPool's region. */
typedef struct backing_object {
    unsigned char *ptr;
    size_t size; /* asked for: what may be written */
    /* what it adds to the backing's bytes_in_use; its block starts a red zone before ptr in a
     * checked pool */
    size_t footprint;
    unsigned char stamp;
} backing_object;

typedef struct backing {
    kva_pool *pool;
    unsigned char *base;
    size_t min_block, redzone; /* redzone: REDZONE in a checked pool, else 0 */
    kva_stats created;         /* as it was created: what it must return to */
    backing_object objects[MAX_OBJECTS];
    size_t nobjects, footprints;
    unsigned char *region; /* the VarPool's block, red zone included; NULL while none */
    size_t region_footprint;
    unsigned char stamp;
} backing;

/* Sizes that reach every path: a unit or less, exact multiples, sizes just past a TLSF class
 * boundary, large ranges, zero and more than the pool. */
static size_t decode_size(input *in, size_t alignment, size_t capacity) {
    unsigned kind = next_byte(in) % 8;
    unsigned v = next_u16(in);
    switch (kind) {
    case 0: return v % alignment + 1;
    case 1: return (size_t)(v % 64 + 1) * alignment;
    case 2: return ((size_t)32 << (v % 10)) * alignment + 1;
    case 3: return (size_t)v * 16 + 1;
    case 4: return capacity / (v % 16 + 1);
    case 5: return v % 4 == 0 ? 0 : capacity + v;
    default: return (size_t)v << (next_byte(in) % 6);
    }
}

static int overlaps(const live_range *live, size_t n, const unsigned char *p, size_t size) {
    for (size_t i = 0; i < n; i++)
        if (p < live[i].ptr + live[i].rounded && live[i].ptr < p + size) return 1;
    return 0;
}

static int intact(const live_range *r) { return r->ptr[0] == r->stamp && r->ptr[r->size - 1] == r->stamp; }

/* ---- the backing pool --------------------------------------------------------------------- */

static kva_stats stats_of(kva_pool *pool) {
    kva_stats s;
    ORACLE(kva_get_stats(pool, &s) == KVA_OK);
    return s;
}

static size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

/* The buddy block a request of `bytes` (red zones included) needs: the power of two that holds
 * it, at least min_block. A refusal for want of memory means no free block is that large. */
static size_t block_for(const backing *b, size_t bytes) {
    size_t block = b->min_block;
    while (block < bytes) block <<= 1;
    return block;
}

static int extents_overlap(const unsigned char *a, size_t a_len, const unsigned char *b, size_t b_len) {
    return a < b + b_len && b < a + a_len;
}

static unsigned char *object_start(const backing *b, const backing_object *o) { return o->ptr - b->redzone; }

static int object_intact(const backing_object *o) { return o->ptr[0] == o->stamp && o->ptr[o->size - 1] == o->stamp; }

/* A small pool, so that kva_check after every operation stays cheap and the VarPool's region
 * (1 MiB and a few units: a 1 or 2 MiB block) sometimes does not fit: 1 .. 4 MiB, plus some
 * blocks, plus sometimes a tail below min_block, which stays unused. */
static void backing_create(input *in, backing *b) {
    unsigned shape = next_byte(in), room = next_byte(in);
    kva_config pc;
    kva_config_init(&pc);
    pc.min_block = (size_t)256 << 4 * (shape % 4); /* 256 B, 4 KiB, 64 KiB, 1 MiB */
    pc.checked = shape >> 2 & 1;
    static const size_t quarter_mib[] = {4, 6, 8, 12, 16};
    pc.capacity = (quarter_mib[room % 5] << 18) + room / 5 % 4 * pc.min_block + (room / 20 % 2 ? 100 : 0);
    pc.pages = KVA_PAGES_SMALL;
    pc.arenas = 1; /* the same placement whichever CPU runs the input */
    memset(b, 0, sizeof *b);
    ORACLE(kva_pool_create(&pc, &b->pool) == KVA_OK);
    void *base;
    ORACLE(kva_pool_base(b->pool, &base) == KVA_OK);
    b->base = base;
    b->min_block = pc.min_block;
    b->redzone = pc.checked ? REDZONE : 0;
    b->created = stats_of(b->pool);
    b->stamp = 0x80;
}

/* One ordinary allocation: a slab object, a buddy block, an exact range, or a size the pool must
 * refuse. Its status, its footprint and its place are checked. */
static void backing_alloc(input *in, backing *b) {
    unsigned kind = next_byte(in) % 5, v = next_u16(in);
    size_t size = kind == 0   ? v % 256 + 1
                  : kind == 1 ? v % KVA_SLAB_MAX_SIZE + 1
                  : kind == 2 ? (size_t)(v % 64 + 1) << 12
                  : kind == 3 ? (size_t)(v % 1024 + 1) * 256
                              : (v & 1 ? 0 : b->created.max_alloc_size + 1 + v);
    if (b->nobjects == MAX_OBJECTS) return;
    size_t need = size + 2 * b->redzone; /* what the pool takes for it */
    kva_stats before = stats_of(b->pool);
    void *p = (void *)0x1;
    kva_status st = kind == 3 ? kva_alloc_exact(b->pool, size, &p) : kva_alloc(b->pool, size, &p);
    kva_stats after = stats_of(b->pool);
    if (st != KVA_OK) {
        ORACLE(p == (void *)0x1 && after.bytes_in_use == before.bytes_in_use);
        if (size == 0 || size > before.max_alloc_size) ORACLE(st == KVA_ERR_INVALID);
        else ORACLE(st == KVA_ERR_NOMEM && after.largest_free < block_for(b, need));
        return;
    }
    ORACLE(size != 0 && size <= before.max_alloc_size);
    size_t footprint = after.bytes_in_use - before.bytes_in_use;
    if (kind == 3) ORACLE(footprint == round_up(need, b->min_block));
    else /* its size class, or a buddy block when no slab could be had */
        ORACLE(footprint == block_for(b, need) ||
               (need <= KVA_SLAB_MAX_SIZE && footprint == kva_size_class_size((unsigned)kva_size_class_of(need))));
    ORACLE(kva_usable_size(b->pool, p) == (b->redzone ? size : footprint));
    backing_object o = {p, size, footprint, b->stamp};
    b->stamp = (unsigned char)(b->stamp == 0xff ? 0x80 : b->stamp + 1); /* apart from the ranges' stamps */
    unsigned char *start = object_start(b, &o);
    ORACLE(start >= b->base && start + footprint <= b->base + b->created.capacity);
    if (b->region) ORACLE(!extents_overlap(start, footprint, b->region, b->region_footprint));
    for (size_t i = 0; i < b->nobjects; i++)
        ORACLE(!extents_overlap(start, footprint, object_start(b, &b->objects[i]), b->objects[i].footprint));
    o.ptr[0] = o.ptr[size - 1] = o.stamp;
    b->objects[b->nobjects++] = o;
    b->footprints += footprint;
}

static void backing_free_object(backing *b, size_t i) {
    backing_object *o = &b->objects[i];
    ORACLE(object_intact(o));
    size_t in_use = stats_of(b->pool).bytes_in_use;
    ORACLE(kva_free(b->pool, o->ptr) == KVA_OK);
    ORACLE(stats_of(b->pool).bytes_in_use == in_use - o->footprint);
    b->footprints -= o->footprint;
    b->objects[i] = b->objects[--b->nobjects];
}

/* After every operation: the backing's own invariants, and its bytes in use are exactly the
 * objects' and the region's. */
static void backing_verify(const backing *b) {
    ORACLE(kva_check(b->pool) == KVA_OK);
    kva_stats s = stats_of(b->pool);
    ORACLE(s.bytes_in_use == b->footprints + (b->region ? b->region_footprint : 0));
    for (size_t i = 0; i < b->nobjects; i++) ORACLE(object_intact(&b->objects[i]));
}

/* kva_var_create over the backing, with exactly the statuses kvalloc.h gives it: KVA_OK where
 * the capacity fits and the backing aligns enough; KVA_ERR_INVALID only for an alignment above
 * 16 over a checked pool; KVA_ERR_NOMEM only when no block of the backing can hold the capacity
 * (past its largest, or none that large free). A refusal leaves the backing as it was. */
static kva_status backing_var_create(backing *b, const kva_var_config *cfg, kva_var **out) {
    size_t bytes = cfg->capacity / cfg->alignment * cfg->alignment, need = bytes + 2 * b->redzone;
    kva_stats before = stats_of(b->pool);
    kva_var *v = (kva_var *)0x1;
    kva_status st = kva_var_create(cfg, b->pool, &v);
    kva_stats after = stats_of(b->pool);
    int fits = bytes <= before.max_alloc_size, refused_alignment = b->redzone && cfg->alignment > REDZONE;
    if (st != KVA_OK) {
        ORACLE(v == (kva_var *)0x1 && after.bytes_in_use == before.bytes_in_use);
        if (st == KVA_ERR_INVALID) ORACLE(refused_alignment);
        else ORACLE(st == KVA_ERR_NOMEM && (!fits || after.largest_free < block_for(b, need)));
        return st;
    }
    ORACLE(fits && !refused_alignment);
    void *base;
    ORACLE(kva_var_base(v, &base) == KVA_OK);
    /* One kva_alloc_exact of the capacity: rounded up to min_block, its start aligned to the
     * power of two above it (a red zone earlier in a checked pool). */
    size_t footprint = after.bytes_in_use - before.bytes_in_use;
    ORACLE(footprint == round_up(need, b->min_block));
    ORACLE(kva_usable_size(b->pool, base) == (b->redzone ? bytes : footprint));
    unsigned char *region = (unsigned char *)base - b->redzone;
    ORACLE(region >= b->base && region + footprint <= b->base + b->created.capacity);
    ORACLE((size_t)(region - b->base) % block_for(b, need) == 0);
    for (size_t i = 0; i < b->nobjects; i++)
        ORACLE(!extents_overlap(region, footprint, object_start(b, &b->objects[i]), b->objects[i].footprint));
    b->region = region;
    b->region_footprint = footprint;
    *out = v;
    return KVA_OK;
}

/* What neither pool may take for its own: a VarPool range (other than the region's start) is no
 * allocation of the backing, and an object of the backing lies outside the VarPool's region. */
static void backing_cross_free(input *in, backing *b, kva_var *v, const live_range *live, size_t nlive) {
    if (nlive > 0) {
        const live_range *r = &live[next_u16(in) % nlive];
        unsigned char *p = r->ptr + (next_byte(in) % 2 ? next_u16(in) % r->rounded : 0);
        if (p != b->region + b->redzone) {
            ORACLE(kva_usable_size(b->pool, p) == 0);
            ORACLE(kva_free(b->pool, p) == KVA_ERR_BAD_POINTER);
        }
    }
    if (b->nobjects > 0) {
        unsigned char *p = b->objects[next_byte(in) % b->nobjects].ptr;
        ORACLE(kva_var_usable_size(v, p) == 0);
        ORACLE(kva_var_free(v, p) == KVA_ERR_BAD_POINTER);
    }
}

/* After kva_var_destroy: the region is free memory of the backing again, and with every object
 * freed the backing is as it was created, and as usable. */
static void backing_finish(backing *b, const kva_var_config *cfg) {
    if (b->region) {
        unsigned char *base = b->region + b->redzone;
        b->region = NULL;
        backing_verify(b);
        ORACLE(kva_usable_size(b->pool, base) == 0);
        ORACLE(kva_free(b->pool, base) == KVA_ERR_DOUBLE_FREE);
    }
    while (b->nobjects > 0) backing_free_object(b, b->nobjects - 1);
    ORACLE(kva_trim(b->pool) == KVA_OK); /* the empty slabs go back too */
    kva_stats s = stats_of(b->pool);
    ORACLE(s.bytes_in_use == 0 && s.live_allocations == 0 && s.slab_bytes == 0);
    ORACLE(s.bytes_free == b->created.bytes_free && s.largest_free == b->created.largest_free);
    ORACLE(kva_check(b->pool) == KVA_OK);
    /* Whole again, with its largest block free: backing_var_create now refuses for want of memory
     * only a capacity past that block, as over the new pool. */
    kva_var *v;
    kva_status st = backing_var_create(b, cfg, &v);
    if (st == KVA_OK) {
        void *base, *p;
        ORACLE(kva_var_base(v, &base) == KVA_OK);
        kva_var_stats vs;
        ORACLE(kva_var_get_stats(v, &vs) == KVA_OK);
        ORACLE(kva_var_alloc(v, vs.capacity, &p) == KVA_OK && p == base);
        ORACLE(kva_var_free(v, p) == KVA_OK);
        kva_var_destroy(v);
        b->region = NULL;
        ORACLE(stats_of(b->pool).bytes_in_use == 0);
    }
    ORACLE(kva_check(b->pool) == KVA_OK);
    kva_pool_destroy(b->pool);
}

/* ---- the harness -------------------------------------------------------------------------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input in = {data, size, 0};
    kva_var_config cfg;
    kva_var_config_init(&cfg);
    unsigned mode = next_byte(&in);
    cfg.policy = (kva_var_policy)(mode % 4);
    cfg.alignment = (size_t)16 << (next_byte(&in) % 9); /* 16 B .. 4 KiB */
    cfg.capacity = ((size_t)1 << 20) + (next_byte(&in) % 4) * cfg.alignment;
    cfg.pages = KVA_PAGES_SMALL;
    static backing backing_pool;
    backing *b = mode & 4 ? &backing_pool : NULL;
    kva_var *v;
    if (b) {
        backing_create(&in, b);
        unsigned before = next_byte(&in) % 4; /* objects that take the backing's first blocks */
        for (unsigned i = 0; i < before; i++) {
            backing_alloc(&in, b);
            backing_verify(b);
        }
        if (backing_var_create(b, &cfg, &v) != KVA_OK) {
            backing_finish(b, &cfg);
            return 0;
        }
        backing_verify(b);
    } else {
        ORACLE(kva_var_create(&cfg, NULL, &v) == KVA_OK);
    }
    void *base_ptr;
    ORACLE(kva_var_base(v, &base_ptr) == KVA_OK);
    unsigned char *base = base_ptr;
    const size_t align = cfg.alignment, capacity = cfg.capacity / align * align;
    static live_range live[MAX_LIVE];
    size_t nlive = 0, used = 0, requested = 0;
    unsigned char stamp = 1;
    unsigned char *freed[32] = {0};
    size_t nfreed = 0;

    while (in.at < in.size) {
        /* Operations 8 .. 10 are the backing's: the seeds of the own pool keep their meaning. */
        unsigned op = next_byte(&in) % (b ? 11 : 8);
        if (op <= 2 && nlive < MAX_LIVE) {
            size_t want = decode_size(&in, align, capacity);
            size_t rounded = (want + align - 1) / align * align;
            kva_var_stats before;
            ORACLE(kva_var_get_stats(v, &before) == KVA_OK);
            void *p = (void *)0x1;
            kva_status st = kva_var_alloc(v, want, &p);
            if (st == KVA_OK) {
                unsigned char *q = p;
                ORACLE(q >= base && q + rounded <= base + capacity);
                ORACLE((uintptr_t)(q - base) % align == 0);
                ORACLE(kva_var_usable_size(v, q) == rounded);
                ORACLE(!overlaps(live, nlive, q, rounded));
                live[nlive] = (live_range){q, want, rounded, stamp++};
                if (stamp == 0x80) stamp = 1; /* the backing's objects use the upper half */
                q[0] = q[want - 1] = live[nlive].stamp;
                nlive++;
                used += rounded;
                requested += want;
            } else {
                ORACLE(p == (void *)0x1); /* a refused call leaves *out untouched */
                if (st == KVA_ERR_INVALID) ORACLE(want == 0 || want > capacity);
                else ORACLE(st == KVA_ERR_NOMEM && before.largest_free < rounded); /* every policy is exact */
            }
        } else if (op <= 4 && nlive > 0) {
            size_t i = next_u16(&in) % nlive;
            ORACLE(intact(&live[i]));
            ORACLE(kva_var_free(v, live[i].ptr) == KVA_OK);
            freed[nfreed++ % 32] = live[i].ptr;
            used -= live[i].rounded;
            requested -= live[i].size;
            live[i] = live[--nlive];
        } else if (op == 5 && nfreed > 0) {
            /* A stale pointer: freeing it must fail unless it was handed out again. */
            unsigned char *p = freed[next_byte(&in) % (nfreed < 32 ? nfreed : 32)];
            int reused = 0;
            for (size_t j = 0; j < nlive; j++) reused |= live[j].ptr == p;
            if (!reused) {
                kva_status st = kva_var_free(v, p);
                ORACLE(st == KVA_ERR_DOUBLE_FREE || st == KVA_ERR_BAD_POINTER);
            }
        } else if (op == 6 && nlive > 0) {
            /* An interior, foreign or NULL pointer is refused and changes nothing. */
            live_range *r = &live[next_u16(&in) % nlive];
            unsigned kind = next_byte(&in) % 3;
            unsigned char *p = kind == 0   ? r->ptr + 1 + next_u16(&in) % r->rounded
                               : kind == 1 ? base - 1 - next_byte(&in)
                                           : NULL;
            int is_start = 0;
            for (size_t j = 0; j < nlive; j++) is_start |= live[j].ptr == p;
            if (!is_start) {
                if (p) ORACLE(kva_var_usable_size(v, p) == 0);
                kva_status st = kva_var_free(v, p);
                ORACLE(p ? st == KVA_ERR_BAD_POINTER || st == KVA_ERR_DOUBLE_FREE : st == KVA_ERR_INVALID);
            }
        } else if (op == 7) {
            ORACLE(kva_var_free(NULL, base) == KVA_ERR_INVALID);
            ORACLE(kva_var_alloc(v, 64, NULL) == KVA_ERR_INVALID);
            if (b) { /* refused creations take nothing from the backing (backing_verify) */
                ORACLE(kva_var_create(&cfg, b->pool, NULL) == KVA_ERR_INVALID);
                kva_var_config bad[3] = {cfg, cfg, cfg};
                bad[0].alignment = 24;                 /* not a power of two */
                bad[1].capacity = cfg.alignment - 1;   /* less than one unit */
                bad[2].capacity = cfg.alignment << 31; /* 2^31 units */
                for (int i = 0; i < 3; i++) {
                    kva_var *untouched = NULL;
                    ORACLE(kva_var_create(&bad[i], b->pool, &untouched) == KVA_ERR_INVALID && untouched == NULL);
                }
            }
        } else if (op == 8) {
            backing_alloc(&in, b);
        } else if (op == 9 && b->nobjects > 0) {
            backing_free_object(b, next_byte(&in) % b->nobjects);
        } else if (op == 10) {
            backing_cross_free(&in, b, v, live, nlive);
        }
        ORACLE(kva_var_check(v) == KVA_OK);
        kva_var_stats s;
        ORACLE(kva_var_get_stats(v, &s) == KVA_OK);
        ORACLE(s.live_allocations == nlive && s.bytes_used == used && s.bytes_requested == requested);
        ORACLE(s.bytes_free == capacity - used && s.largest_free <= s.bytes_free);
        if (b) backing_verify(b);
    }
    for (size_t i = 0; i < nlive; i++) {
        ORACLE(intact(&live[i]));
        ORACLE(kva_var_free(v, live[i].ptr) == KVA_OK);
    }
    kva_var_stats s;
    ORACLE(kva_var_get_stats(v, &s) == KVA_OK);
    ORACLE(s.bytes_free == capacity && s.free_ranges == 1 && s.largest_free == capacity);
    ORACLE(kva_var_check(v) == KVA_OK);
    kva_var_destroy(v);
    if (b) backing_finish(b, &cfg);
    return 0;
}
