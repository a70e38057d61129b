/*
 * test_random.c — a randomized differential test: millions of mixed allocations and frees
 * against a shadow model of what should be live.
 *
 *  - Each allocation is stamped with (id ^ cookie) at both ends; the stamps are verified at free,
 *    so two allocations that overlap are caught as soon as one is freed.
 *  - Every 10,000 operations kva_check runs and the heap walk is compared with the model: the
 *    walk's live ranges must be exactly the model's allocations, start for start.
 *  - Every out-of-memory is justified: no free block large enough may exist.
 *
 * Usage: test_random [OPS] [SEED]   (the seed is printed, so a failure can be replayed)
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvalloc.h"

#define CHECK_EVERY 10000
#define MAX_LIVE 200000

typedef struct live_alloc {
    unsigned char *ptr;
    size_t size;
    uint64_t id;
} live_alloc;

static uint64_t rng_state;
static uint64_t next_random(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static size_t random_between(size_t lo, size_t hi) { return lo + (size_t)(next_random() % (hi - lo + 1)); }

static const uint64_t cookie = 0x6b7661636f6f6b69ull;
static live_alloc live[MAX_LIVE];
static size_t nlive;

/* Allocations under 16 bytes are stamped whole, byte by byte; larger ones in their first and
 * last 8 bytes. */
static unsigned char mark_byte(const live_alloc *a, size_t i) {
    return (unsigned char)((a->id ^ cookie) >> (8 * (i % 8)));
}

static void stamp(const live_alloc *a) {
    if (a->size < 16) {
        for (size_t i = 0; i < a->size; i++) a->ptr[i] = mark_byte(a, i);
        return;
    }
    for (size_t i = 0; i < 8; i++) a->ptr[i] = a->ptr[a->size - 8 + i] = mark_byte(a, i);
}

static int stamp_intact(const live_alloc *a) {
    if (a->size < 16) {
        for (size_t i = 0; i < a->size; i++)
            if (a->ptr[i] != mark_byte(a, i)) return 0;
        return 1;
    }
    for (size_t i = 0; i < 8; i++)
        if (a->ptr[i] != mark_byte(a, i) || a->ptr[a->size - 8 + i] != mark_byte(a, i)) return 0;
    return 1;
}

/* The request sizes of a KV-cache engine: token metadata, pages, scratch, and large blocks. */
static size_t random_size(void) {
    uint64_t r = next_random() % 100;
    if (r < 25) return 64;
    if (r < 50) return random_between(1, 1024);
    if (r < 60) return 4096;
    if (r < 80) return random_between(1025, 65536);
    return (size_t)1 << random_between(16, 22) | random_between(0, 65535); /* 64 KiB .. 4 MiB */
}

static size_t smallest_block_for(size_t size, const kva_stats *st) {
    size_t block = st->min_block;
    while (block < size) block *= 2;
    return block;
}

static int by_address(const void *a, const void *b) {
    const live_alloc *x = a, *y = b;
    return x->ptr < y->ptr ? -1 : x->ptr > y->ptr;
}

typedef struct walk_cursor {
    unsigned char *base;
    size_t next; /* index into the sorted model */
    int mismatch;
} walk_cursor;

static int compare_range(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    walk_cursor *c = ctx;
    if (kind != KVA_WALK_BLOCK && kind != KVA_WALK_SLAB_OBJECT) return 0;
    if (c->next >= nlive || live[c->next].ptr != c->base + offset || live[c->next].size > size) {
        c->mismatch = 1;
        return 1;
    }
    c->next++;
    return 0;
}

static void compare_with_model(kva_pool *pool, unsigned char *base, uint64_t op) {
    CHECK_STATUS(kva_check(pool), KVA_OK);
    qsort(live, nlive, sizeof *live, by_address);
    walk_cursor cursor = {.base = base};
    CHECK_STATUS(kva_walk(pool, compare_range, &cursor), KVA_OK);
    if (cursor.mismatch || cursor.next != nlive) {
        fprintf(stderr, "op %" PRIu64 ": heap walk disagrees with the model at entry %zu of %zu\n", op, cursor.next,
                nlive);
        check_failures++;
    }
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.live_allocations == nlive);
}

int main(int argc, char **argv) {
    uint64_t ops = argc > 1 ? strtoull(argv[1], NULL, 0) : 1000000;
    uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 0) : 20261129;
    printf("test_random: %" PRIu64 " operations, seed %" PRIu64 " (replay: test_random %" PRIu64 " %" PRIu64 ")\n", ops,
           seed, ops, seed);
    rng_state = seed;

    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = ((size_t)128 << 20) + ((size_t)3 << 20) + 8192; /* not a power of two */
    kva_pool *pool;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    void *base_ptr;
    kva_pool_base(pool, &base_ptr);
    unsigned char *base = base_ptr;

    uint64_t next_id = 1, nomem = 0, frees = 0, allocs = 0;
    for (uint64_t op = 1; op <= ops && check_failures == 0; op++) {
        /* Alternate phases that fill the pool (and hit out-of-memory) and that drain it. */
        int filling = (op / 50000) % 2 == 0;
        int do_alloc = nlive == 0 || (nlive < MAX_LIVE && next_random() % 100 < (filling ? 62u : 38u));
        if (do_alloc) {
            size_t size = random_size();
            void *p;
            int aligned = next_random() % 50 == 0, exact = !aligned && size > 65536 && next_random() % 4 == 0;
            size_t alignment = (size_t)1 << random_between(4, 16);
            kva_status st = aligned ? kva_alloc_aligned(pool, size, alignment, &p)
                            : exact ? kva_alloc_exact(pool, size, &p)
                                    : kva_alloc(pool, size, &p);
            if (st == KVA_ERR_NOMEM) {
                /* Justified only if no free block could have held it. */
                kva_stats s;
                kva_get_stats(pool, &s);
                size_t need = smallest_block_for(aligned && alignment > size ? alignment : size, &s);
                if (s.largest_free >= need) {
                    fprintf(stderr, "op %" PRIu64 ": NOMEM for %zu bytes with a free block of %zu\n", op, size,
                            s.largest_free);
                    check_failures++;
                }
                nomem++;
                continue;
            }
            CHECK_STATUS(st, KVA_OK);
            if (st != KVA_OK) break;
            size_t usable = kva_usable_size(pool, p);
            CHECK(usable >= size);
            if (aligned) CHECK((uintptr_t)p % alignment == 0);
            live_alloc a = {.ptr = p, .size = size, .id = next_id++};
            stamp(&a);
            live[nlive++] = a;
            allocs++;
        } else {
            size_t i = (size_t)(next_random() % nlive);
            live_alloc a = live[i];
            if (!stamp_intact(&a)) {
                fprintf(stderr, "op %" PRIu64 ": allocation %" PRIu64 " (%zu bytes at %p) was overwritten\n", op, a.id,
                        a.size, (void *)a.ptr);
                for (size_t j = 0; j < nlive; j++)
                    if (j != i && live[j].ptr < a.ptr + a.size && a.ptr < live[j].ptr + live[j].size)
                        fprintf(stderr, "  overlaps allocation %" PRIu64 " (%zu bytes at %p, usable %zu)\n", live[j].id,
                                live[j].size, (void *)live[j].ptr, kva_usable_size(pool, live[j].ptr));
                fprintf(stderr, "  usable size %zu\n", kva_usable_size(pool, a.ptr));
                check_failures++;
            }
            CHECK_STATUS(kva_free(pool, a.ptr), KVA_OK);
            live[i] = live[--nlive];
            frees++;
            if (next_random() % 1000 == 0) {
                CHECK_STATUS(kva_free(pool, a.ptr), KVA_ERR_DOUBLE_FREE); /* the double free is refused */
            }
        }
        if (op % 100000 == 0) kva_trim(pool);
        if (op % CHECK_EVERY == 0) compare_with_model(pool, base, op);
    }
    compare_with_model(pool, base, ops);
    while (nlive) {
        CHECK(stamp_intact(&live[nlive - 1]));
        CHECK_STATUS(kva_free(pool, live[--nlive].ptr), KVA_OK);
    }
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.bytes_free == st.capacity && st.bytes_in_use == 0 && st.slab_count == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    printf("test_random: %" PRIu64 " allocations, %" PRIu64 " frees, %" PRIu64 " out-of-memory\n", allocs, frees,
           nomem);
    kva_pool_destroy(pool);
    return CHECK_DONE();
}
