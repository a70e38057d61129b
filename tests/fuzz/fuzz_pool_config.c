/*
 * fuzz_pool_config.c — the pool across its configurations, where fuzz_pool keeps one: the
 * input's first bytes choose min_block (256 B .. 16 KiB), slab_chunk (64 .. 256 KiB), one or
 * two arenas, checked mode, an external range (memory the harness owns, at a base aligned to
 * 64 KiB .. 2 MiB: refused when its rules are broken, and a second pool over it always refused)
 * and a capacity that is no multiple of anything (rounded to pages for most external ranges);
 * the rest drives every
 * allocation entry point (kva_alloc_array with overflowing counts too), frees of live, stale,
 * interior and foreign pointers, red-zone overruns in checked pools, kva_walk, kva_trim,
 * kva_thread_flush and the class statistics, against a model of the live allocations.
 *
 * After every step: kva_check passes and the live count is the model's. kva_usable_size is the
 * size asked for in a checked pool (at least it otherwise) and 0 for anything that is not a live
 * allocation's start; the walk lists the live allocations, in address order, without overlap.
 * Checked mode and kva_walk are reached here only: fuzz_pool's single configuration covers
 * neither.
 */
#define _GNU_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "fuzz_input.h"
#include "kvalloc.h"

#define MAX_LIVE 256
#define MAX_FREED 32

typedef struct live_alloc {
    unsigned char *ptr;
    size_t size;
    unsigned char stamp; /* written at both ends, checked at the free */
} live_alloc;

static live_alloc live[MAX_LIVE];
static size_t nlive;
static unsigned char *base;

static size_t decode_size(input *in) {
    unsigned kind = next_byte(in) % 8, v = next_u16(in);
    switch (kind) {
    case 0: return v % 64 + 1;
    case 1: return (size_t)16 << (v % 13);
    case 2: return ((size_t)16 << (v % 13)) + 1;
    case 3: return v % 65536 + 1;
    case 4: return 65536 + v;
    case 5: return (size_t)(v % 40 + 1) << 14;
    case 6: return (size_t)1 << (v % 24);
    default: return (size_t)v << (next_byte(in) % 12);
    }
}

static int overlaps_a_live_one(const unsigned char *p, size_t size) {
    for (size_t i = 0; i < nlive; i++)
        if (p < live[i].ptr + live[i].size && live[i].ptr < p + size) return 1;
    return 0;
}

static int is_live_start(const unsigned char *p) {
    for (size_t i = 0; i < nlive; i++)
        if (live[i].ptr == p) return 1;
    return 0;
}

/* What the walk saw: flags of what was wrong, and the live ranges it counted. */
typedef struct walk_seen {
    uint64_t block_end, previous;
    size_t objects, blocks, total;
    int wrong;
} walk_seen;

static int walk_step(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    walk_seen *w = ctx;
    if (size == 0) w->wrong |= 1;
    if (offset < w->previous) w->wrong |= 2; /* every range in address order */
    w->previous = offset;
    if (kind == KVA_WALK_FREE || kind == KVA_WALK_BLOCK) {
        if (offset < w->block_end) w->wrong |= 4; /* buddy-level ranges do not overlap */
        w->block_end = offset + size;
        w->total += size;
    }
    if (kind == KVA_WALK_BLOCK || kind == KVA_WALK_SLAB_OBJECT) {
        int holds_one = 0; /* a live range holds a live allocation's start */
        for (size_t i = 0; i < nlive; i++) {
            uint64_t start = (uint64_t)(live[i].ptr - base);
            holds_one |= start >= offset && start < offset + size;
        }
        if (!holds_one) w->wrong |= 8;
        if (kind == KVA_WALK_BLOCK) w->blocks++;
        else w->objects++;
    }
    return 0;
}

static kva_status allocate(kva_pool *pool, unsigned how, input *in, size_t *want, size_t *alignment, void **p) {
    *want = decode_size(in);
    *alignment = (size_t)1 << (next_byte(in) % 18);
    switch (how) {
    case 0: return kva_alloc(pool, *want, p);
    case 1: return kva_alloc_aligned(pool, *want, *alignment, p);
    case 2: return kva_alloc_exact(pool, *want, p);
    default: {
        size_t count = next_byte(in) % 9;
        if (count == 0) { /* count × size overflows: refused */
            kva_status st = kva_alloc_array(pool, SIZE_MAX / 2, 3, p);
            ORACLE(st == KVA_ERR_INVALID);
            return st;
        }
        size_t each = (*want + count - 1) / count;
        *want = count * each;
        return kva_alloc_array(pool, count, each, p);
    }
    }
}

#define EXTERNAL_SPAN ((size_t)8 << 20)

/* The harness's own memory for external pools: 2 MiB aligned, mapped once for the run. */
static unsigned char *external_memory(void) {
    static unsigned char *memory;
    if (!memory) {
        size_t align = (size_t)2 << 20;
        unsigned char *raw = mmap(NULL, EXTERNAL_SPAN + align, PROT_READ | PROT_WRITE,
                                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (raw == MAP_FAILED) abort();
        memory = (unsigned char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
    }
    return memory;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input in = {data, size, 0};
    kva_config cfg;
    kva_config_init(&cfg);
    unsigned choice = next_byte(&in);
    cfg.min_block = (size_t)256 << (choice % 7);
    cfg.slab_chunk = ((size_t)64 << 10) << ((choice >> 3) % 3);
    cfg.checked = (choice >> 5) & 1;
    cfg.arenas = 1 + ((choice >> 6) & 1);
    cfg.capacity = ((size_t)1 << 20) * (1 + next_byte(&in) % 4) + (size_t)(next_byte(&in) % 8) * 256 +
                   next_byte(&in) % 3;
    cfg.pages = KVA_PAGES_SMALL;
    int external = choice >> 7;
    if (external) {
        unsigned where = next_byte(&in);
        cfg.pages = KVA_PAGES_AUTO;
        cfg.slab_chunk = where & 1 ? 0 : cfg.slab_chunk; /* automatic: follows the base */
        cfg.external = external_memory() + ((size_t)64 << 10) * ((where >> 1) % 32);
        if ((where >> 6) != 0) cfg.capacity &= ~(size_t)4095;
    }
    kva_pool *pool;
    kva_status created = kva_pool_create(&cfg, &pool);
    if (created != KVA_OK) {
        ORACLE(created == KVA_ERR_INVALID);
        ORACLE(!external || cfg.checked || cfg.capacity % 4096 || cfg.slab_chunk);
        return 0;
    }
    if (external) {
        kva_pool *twin = (kva_pool *)0x1;
        ORACLE(kva_pool_create(&cfg, &twin) == KVA_ERR_INVALID && twin == (kva_pool *)0x1);
    }
    void *b;
    kva_pool_base(pool, &b);
    base = b;
    kva_stats initial;
    kva_get_stats(pool, &initial);
    nlive = 0;
    unsigned char stamp = 1;
    unsigned char *freed[MAX_FREED] = {0};
    size_t nfreed = 0;

    while (in.at < in.size) {
        unsigned op = next_byte(&in) % 12;
        if (op <= 3 && nlive < MAX_LIVE) {
            size_t want, alignment;
            void *p = (void *)0x1;
            kva_status st = allocate(pool, op, &in, &want, &alignment, &p);
            if (st == KVA_OK) {
                unsigned char *q = p;
                size_t usable = kva_usable_size(pool, q);
                ORACLE(cfg.checked ? usable == want : usable >= want);
                ORACLE(q >= base && q + want <= base + initial.capacity);
                ORACLE(op != 1 || (uintptr_t)q % alignment == 0);
                ORACLE(!overlaps_a_live_one(q, want));
                live[nlive] = (live_alloc){q, want, stamp};
                stamp = stamp == 255 ? 1 : stamp + 1;
                memset(q, live[nlive].stamp, want < 256 ? want : 256);
                q[want - 1] = live[nlive].stamp;
                nlive++;
            } else {
                ORACLE(p == (void *)0x1);
                ORACLE(st == KVA_ERR_NOMEM || st == KVA_ERR_INVALID);
                /* INVALID only for what no pool state could give: alignment and array requests
                 * have rules of their own. */
                if (st == KVA_ERR_INVALID) ORACLE(want == 0 || want > initial.max_alloc_size || op == 1 || op == 3);
            }
        } else if (op <= 5 && nlive > 0) {
            /* A live allocation's free; in a checked pool, sometimes after a write just outside it. */
            size_t i = next_u16(&in) % nlive;
            live_alloc *a = &live[i];
            ORACLE(a->ptr[0] == a->stamp && a->ptr[a->size - 1] == a->stamp);
            int overrun = cfg.checked && next_byte(&in) % 4 == 0;
            if (overrun) {
                if (next_byte(&in) & 1) a->ptr[-1] ^= 0x5a;
                else a->ptr[a->size] ^= 0x5a;
            }
            kva_status st = kva_free(pool, a->ptr);
            ORACLE(overrun ? st == KVA_ERR_CORRUPT : st == KVA_OK); /* freed either way */
            ORACLE(kva_usable_size(pool, a->ptr) == 0);
            freed[nfreed++ % MAX_FREED] = a->ptr;
            live[i] = live[--nlive];
        } else if (op == 6 && nfreed > 0) {
            /* A stale pointer, unless it was handed out again. */
            unsigned char *p = freed[next_byte(&in) % (nfreed < MAX_FREED ? nfreed : MAX_FREED)];
            if (!is_live_start(p)) {
                ORACLE(kva_usable_size(pool, p) == 0);
                kva_status st = kva_free(pool, p);
                ORACLE(st == KVA_ERR_DOUBLE_FREE || st == KVA_ERR_BAD_POINTER);
            }
        } else if (op == 7 && nlive > 0) {
            /* Interior, below the pool, past it, or anywhere inside it. */
            live_alloc *a = &live[next_u16(&in) % nlive];
            unsigned where = next_byte(&in) % 4;
            unsigned char *p = where == 0   ? a->ptr + 1 + next_u16(&in) % a->size
                               : where == 1 ? base - 1 - next_byte(&in)
                               : where == 2 ? base + initial.capacity + next_u16(&in)
                                            : base + ((size_t)next_u16(&in) << 4) % initial.capacity;
            if (!is_live_start(p)) {
                ORACLE(kva_usable_size(pool, p) == 0);
                kva_status st = kva_free(pool, p);
                ORACLE(st == KVA_ERR_BAD_POINTER || st == KVA_ERR_DOUBLE_FREE);
            }
        } else if (op == 8) {
            walk_seen w = {0};
            ORACLE(kva_walk(pool, walk_step, &w) == KVA_OK);
            if (w.wrong) fprintf(stderr, "walk: wrong %d\n", w.wrong);
            ORACLE(w.wrong == 0);
            ORACLE(w.objects + w.blocks == nlive);
            ORACLE(w.total <= initial.capacity);
        } else if (op == 9) {
            ORACLE(kva_trim(pool) == KVA_OK);
        } else if (op == 10) {
            ORACLE(kva_thread_flush(pool) == KVA_OK);
        } else if (op == 11) {
            kva_class_stats cs;
            unsigned index = next_byte(&in) % (KVA_NUM_SIZE_CLASSES + 2);
            kva_status st = kva_get_class_stats(pool, index, &cs);
            ORACLE(index < KVA_NUM_SIZE_CLASSES ? st == KVA_OK : st == KVA_ERR_INVALID);
        }
        kva_status checked = kva_check(pool);
        if (checked != KVA_OK) fprintf(stderr, "kva_check: %s\n", kva_last_error());
        ORACLE(checked == KVA_OK);
        kva_stats st;
        kva_get_stats(pool, &st);
        ORACLE(st.live_allocations == nlive);
    }
    for (size_t i = 0; i < nlive; i++) ORACLE(kva_free(pool, live[i].ptr) == KVA_OK);
    ORACLE(kva_trim(pool) == KVA_OK);
    kva_stats st;
    kva_get_stats(pool, &st);
    ORACLE(st.bytes_free == st.capacity);
    ORACLE(kva_check(pool) == KVA_OK);
    kva_pool_destroy(pool);
    return 0;
}
