/*
 * fuzz_var.c — libFuzzer harness for the variable-size pools: the input bytes choose a policy
 * (first, best, worst fit or TLSF), an alignment and a capacity, then a sequence of
 * allocations, frees (good, double, interior, foreign, NULL) and size queries, run against a
 * shadow model of what is live. kva_var_check after every operation is the oracle, with the
 * model: a broken invariant, a wrong status, an overlap, a misaligned or overwritten range, a
 * refused allocation while a free range could hold it, or statistics that disagree with the
 * model abort, which libFuzzer reports as a crash with the input that caused it.
 *
 * Build and run: make fuzz (clang's -fsanitize=fuzzer,address,undefined).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"
#include "kvalloc.h"

#define MAX_LIVE 256

typedef struct live_range {
    unsigned char *ptr;
    size_t size, rounded;
    unsigned char stamp;
} live_range;

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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input in = {data, size, 0};
    kva_var_config cfg;
    kva_var_config_init(&cfg);
    cfg.policy = (kva_var_policy)(next_byte(&in) % 4);
    cfg.alignment = (size_t)16 << (next_byte(&in) % 9); /* 16 B .. 4 KiB */
    cfg.capacity = ((size_t)1 << 20) + (next_byte(&in) % 4) * cfg.alignment;
    cfg.pages = KVA_PAGES_SMALL;
    kva_var *v;
    ORACLE(kva_var_create(&cfg, NULL, &v) == KVA_OK);
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
        unsigned op = next_byte(&in) % 8;
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
                if (!stamp) stamp = 1;
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
            unsigned char *p = kind == 0 ? r->ptr + 1 + next_u16(&in) % r->rounded
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
        }
        ORACLE(kva_var_check(v) == KVA_OK);
        kva_var_stats s;
        ORACLE(kva_var_get_stats(v, &s) == KVA_OK);
        ORACLE(s.live_allocations == nlive && s.bytes_used == used && s.bytes_requested == requested);
        ORACLE(s.bytes_free == capacity - used && s.largest_free <= s.bytes_free);
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
    return 0;
}
