/*
 * fuzz_pool.c — libFuzzer harness for the pool: the input bytes are decoded into a sequence of
 * allocations, frees (good, double, interior, foreign), trims and checks on a small pool, run
 * against a shadow model of what is live. kva_check after every operation is the oracle, with
 * the model: any broken invariant, wrong status, overlap or overwritten allocation aborts, which
 * libFuzzer reports as a crash with the input that caused it.
 *
 * Build and run: make fuzz (clang's -fsanitize=fuzzer,address,undefined).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"
#include "kvalloc.h"

#define MAX_LIVE 512

typedef struct live_alloc {
    unsigned char *ptr;
    size_t size;
    unsigned char stamp;
} live_alloc;

/* Request sizes that reach every path: tiny slab objects, the KV page sizes, slab boundaries,
 * buddy blocks, odd sizes and ones larger than the pool. */
static size_t decode_size(input *in) {
    unsigned kind = next_byte(in) % 8;
    unsigned v = next_u16(in);
    switch (kind) {
    case 0: return v % 64 + 1;
    case 1: return 64;
    case 2: return 4096;
    case 3: return v % 65536 + 1;
    case 4: return 65536 + v;
    case 5: return (size_t)(v % 40 + 1) << 15; /* up to 1.25 MiB */
    case 6: return (size_t)1 << (v % 24);
    default: return (size_t)v << (next_byte(in) % 12);
    }
}

static int overlaps(const live_alloc *live, size_t n, const unsigned char *p, size_t size) {
    for (size_t i = 0; i < n; i++)
        if (p < live[i].ptr + live[i].size && live[i].ptr < p + size) return 1;
    return 0;
}

static int intact(const live_alloc *a) { return a->ptr[0] == a->stamp && a->ptr[a->size - 1] == a->stamp; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input in = {data, size, 0};
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = ((size_t)4 << 20) + (next_byte(&in) % 4) * 4096; /* sometimes not a power of two */
    cfg.slab_chunk = (size_t)64 << 10;
    cfg.pages = KVA_PAGES_SMALL;
    kva_pool *pool;
    ORACLE(kva_pool_create(&cfg, &pool) == KVA_OK);
    void *base_ptr;
    kva_pool_base(pool, &base_ptr);
    kva_stats initial;
    kva_get_stats(pool, &initial);
    unsigned char *base = base_ptr;
    static live_alloc live[MAX_LIVE];
    size_t nlive = 0;
    unsigned char stamp = 1;
    unsigned char *freed[64] = {0}; /* recently freed starts, for double frees */
    size_t nfreed = 0;

    while (in.at < in.size) {
        unsigned op = next_byte(&in) % 10;
        if (op <= 3 && nlive < MAX_LIVE) {
            size_t want = decode_size(&in);
            void *p = (void *)0x1;
            kva_status st;
            size_t alignment = (size_t)1 << (next_byte(&in) % 20);
            if (op == 2) st = kva_alloc_aligned(pool, want, alignment, &p);
            else if (op == 3) st = kva_alloc_exact(pool, want, &p);
            else st = kva_alloc(pool, want, &p);
            if (st == KVA_OK) {
                size_t usable = kva_usable_size(pool, p);
                ORACLE(usable >= want);
                ORACLE((unsigned char *)p >= base && (unsigned char *)p + want <= base + cfg.capacity);
                if (op == 2) ORACLE((uintptr_t)p % alignment == 0);
                ORACLE(!overlaps(live, nlive, p, want));
                live[nlive] = (live_alloc){p, want, stamp++};
                if (!stamp) stamp = 1;
                live[nlive].ptr[0] = live[nlive].ptr[want - 1] = live[nlive].stamp;
                nlive++;
            } else {
                ORACLE(p == (void *)0x1); /* a failed call leaves *out untouched */
                ORACLE(st == KVA_ERR_NOMEM || st == KVA_ERR_INVALID);
                if (st == KVA_ERR_INVALID) ORACLE(want == 0 || want > initial.max_alloc_size || op == 2);
            }
        } else if (op <= 6 && nlive > 0) {
            size_t i = next_u16(&in) % nlive;
            ORACLE(intact(&live[i]));
            ORACLE(kva_free(pool, live[i].ptr) == KVA_OK);
            freed[nfreed++ % 64] = live[i].ptr;
            live[i] = live[--nlive];
        } else if (op == 7 && nfreed > 0) {
            /* A stale pointer: freeing it must fail unless it was handed out again. */
            unsigned char *p = freed[next_byte(&in) % (nfreed < 64 ? nfreed : 64)];
            int reused = 0;
            for (size_t j = 0; j < nlive; j++) reused |= live[j].ptr == p;
            if (!reused) {
                /* One call: a second would pass on DOUBLE_FREE even if the first wrongly freed. */
                kva_status st = kva_free(pool, p);
                ORACLE(st == KVA_ERR_DOUBLE_FREE || st == KVA_ERR_BAD_POINTER);
            }
        } else if (op == 8 && nlive > 0) {
            /* An interior or foreign pointer is refused and changes nothing. */
            live_alloc *a = &live[next_u16(&in) % nlive];
            size_t delta = next_u16(&in) % (a->size + 1);
            unsigned char *p = delta ? a->ptr + delta : base - 1 - next_byte(&in);
            kva_status st = kva_free(pool, p);
            int is_start = 0;
            for (size_t j = 0; j < nlive; j++) is_start |= live[j].ptr == p;
            if (!is_start) ORACLE(st == KVA_ERR_BAD_POINTER || st == KVA_ERR_DOUBLE_FREE);
            else {
                /* delta landed on another live allocation's start: it was really freed. */
                ORACLE(st == KVA_OK);
                for (size_t j = 0; j < nlive; j++)
                    if (live[j].ptr == p) {
                        live[j] = live[--nlive];
                        break;
                    }
            }
        } else if (op == 9) {
            ORACLE(kva_trim(pool) == KVA_OK);
        }
        ORACLE(kva_check(pool) == KVA_OK);
        kva_stats st;
        kva_get_stats(pool, &st);
        ORACLE(st.live_allocations == nlive);
    }
    for (size_t i = 0; i < nlive; i++) {
        ORACLE(intact(&live[i]));
        ORACLE(kva_free(pool, live[i].ptr) == KVA_OK);
    }
    ORACLE(kva_trim(pool) == KVA_OK);
    kva_stats st;
    kva_get_stats(pool, &st);
    ORACLE(st.bytes_free == st.capacity);
    kva_pool_destroy(pool);
    return 0;
}
