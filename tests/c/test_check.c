/*
 * test_check.c — kva_check names the first broken invariant. The test reaches into the pool's
 * metadata through the internal headers (the test-only hook), breaks one invariant at a time,
 * and restores it: check must report exactly that invariant, then pass again.
 */
#include <string.h>

#include "check.h"
#include "kvalloc.h"
#include "pool.h"
#include "tcache.h"

static kva_pool *pool;

static int count_ranges(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    (void)offset, (void)size, (void)kind;
    ++*(unsigned *)ctx;
    return 0;
}

/* kva_walk on broken metadata: KVA_ERR_CORRUPT, not a loop or a read out of bounds. */
static void expect_walk_refused(int line) {
    unsigned ranges = 0;
    kva_status st = kva_walk(pool, count_ranges, &ranges);
    if (st != KVA_ERR_CORRUPT) {
        fprintf(stderr, "line %d: kva_walk returned %d after %u ranges, expected KVA_ERR_CORRUPT\n", line, st, ranges);
        check_failures++;
    }
}

/* Runs kva_check and verifies it names the invariant `code` ("B3", "S2", ...). */
static void expect_broken(const char *code, int line) {
    kva_status st = kva_check(pool);
    const char *msg = kva_last_error();
    if (st != KVA_ERR_CORRUPT || strncmp(msg, code, strlen(code)) != 0) {
        fprintf(stderr, "line %d: expected %s broken, got status %d: %s\n", line, code, st, msg);
        check_failures++;
    }
}

#define CORRUPT(code, lvalue, bad)             \
    do {                                       \
        __typeof__(lvalue) saved_ = (lvalue);  \
        (lvalue) = (bad);                      \
        expect_broken(code, __LINE__);         \
        (lvalue) = saved_;                     \
        CHECK_STATUS(kva_check(pool), KVA_OK); \
    } while (0)

int main(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)16 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    void *objs[100], *blocks[4];
    for (int i = 0; i < 100; i++) REQUIRE(kva_alloc(pool, 64, &objs[i]) == KVA_OK);
    for (int i = 0; i < 4; i++) REQUIRE(kva_alloc(pool, 100000 * (i + 1), &blocks[i]) == KVA_OK);
    REQUIRE(kva_free(pool, blocks[1]) == KVA_OK);
    /* The cache keeps dry word 0 too; given everything back, the next object claims word 1
     * alone, leaving word 0 dry and unowned. */
    void *extra, *freed;
    REQUIRE(kva_thread_flush(pool) == KVA_OK && kva_alloc(pool, 64, &extra) == KVA_OK);
    /* Two fast frees in the slab open the cache's free window on word 1. */
    for (int i = 0; i < 2; i++) REQUIRE(kva_alloc(pool, 64, &freed) == KVA_OK && kva_free(pool, freed) == KVA_OK);
    /* A slab of 48 B objects: its l0 words do not fill its last l1 word. */
    void *odd;
    REQUIRE(kva_alloc(pool, 48, &odd) == KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);

    kva_buddy *b = &pool->buddy;
    kva_slabs *sl = &pool->slabs;
    uint32_t used = (uint32_t)(((unsigned char *)blocks[0] - pool->base) >> b->min_shift);
    uint32_t slab_chunk = (uint32_t)(((unsigned char *)objs[0] - pool->base) >> sl->chunk_shift);
    kva_slab *slab = &sl->slabs[slab_chunk];
    unsigned c = slab->cls;
    const kva_class_geometry *g = &sl->geom[c];
    uint64_t *l0 = slab->l0;
    kva_arena_class *ac = &sl->arenas[slab->arena].classes[c];
    kva_tc_class *cached = &kva_tc_current->cls[c]; /* this thread's cache: word 1 is its current */
    REQUIRE(kva_tc_current->pool == pool && cached->nowned == 1 && cached->word[0] == 1);
    uint32_t *owner = kva_slab_owner(slab, g);
    unsigned free_order = kva_ctz64(b->nonempty);
    uint32_t free_head = b->free_head[free_order];

    CORRUPT("B1", b->pages[used + 1].state, KVA_BLOCK_USED); /* a stray head inside a block */
    CORRUPT("B1", b->pages[used].state, KVA_BLOCK_NONE);     /* a block without a head */
    CORRUPT("B1", b->pages[used].order, (uint8_t)(b->num_orders + 1));
    CORRUPT("B1", b->pages[used].next, b->pages[used].next * 2); /* longer than its block */
    CORRUPT("B3", b->pages[free_head].prev, 7);                  /* a broken back link */
    CORRUPT("B3", b->free_count[free_order], b->free_count[free_order] + 1);
    CORRUPT("B4", b->nonempty, b->nonempty | ((uint64_t)1 << (b->num_orders - 1)));
    CORRUPT("B6", b->free_units, b->free_units + 1);
    CORRUPT("S6", cached->word[0], 5); /* the cache lists a word it does not own */
    kva_tc_window *win = kva_tc_window_of(kva_tc_current, (uintptr_t)freed);
    REQUIRE(win->span != 0);
    CORRUPT("S6", win->base, win->base + 64);                 /* a window off its word */
    CORRUPT("S6", win->span, win->span + 64);                 /* wider than its word */
    CORRUPT("S6", win->frees, &kva_tc_current->frees[c + 1]); /* another class's counter */
    CORRUPT("S6", owner[1], owner[1] + 1);                    /* the word names another cache as its owner */
    CORRUPT("S6", owner[0], kva_tc_current->id);              /* a word owned but listed by no cache */
    uint32_t not_a_slab = (uint32_t)(((unsigned char *)blocks[3] - pool->base) >> sl->chunk_shift);
    CORRUPT("S1", sl->slabs[not_a_slab].cls, (uint8_t)c); /* the slab says slab, the buddy says no */
    CORRUPT("S2", l0[0], l0[0] | 1);                      /* a live object marked free */
    CORRUPT("S2", owner[2], kva_tc_current->id + 7);      /* a listed word claimed behind l1's back */
    CORRUPT("S2", slab->l2, 0);                           /* summary disagrees with l1 */
    CORRUPT("S2", slab->inuse, slab->inuse + 1);
    CORRUPT("S1", slab->magic, slab->magic + 1); /* the fast path's copy */
    CORRUPT("S3", ac->partial_head, KVA_NIL);    /* a partial slab on no list */
    CORRUPT("S4", ac->empty_slab, 3);
    CORRUPT("S5", kva_tc_current->hot[c].allocs, kva_tc_current->hot[c].allocs + 1);
    CORRUPT("S5", ac->slabs, ac->slabs + 1);
    /* What a corruption must not do to the check itself: crash it, hang it, or pass. */
    kva_tcache *me = kva_tc_current;
    unsigned unused_class = (unsigned)kva_size_class_of(40); /* never allocated here */
    REQUIRE(me->cls[unused_class].cur == KVA_NIL);
    CORRUPT("S6", me->hot[unused_class].l0, (uint64_t *)0x10); /* compared, not read */
    CORRUPT("S6", me->hot[unused_class].remote, (uint64_t *)0x10);
    CORRUPT("S6", me->hot[c].size, me->hot[c].size + 16); /* the fast path multiplies by it */
    CORRUPT("S6", me->pool_next, me);                     /* a loop in the pool's caches */
    CORRUPT("S1", slab->l0, (uint64_t *)0x1000);          /* before the totals read it */
    CORRUPT("S1", slab->l0_words, 0x40000000);
    uint32_t odd_chunk = (uint32_t)(((unsigned char *)odd - pool->base) >> sl->chunk_shift);
    const kva_class_geometry *odd_g = &sl->geom[sl->slabs[odd_chunk].cls];
    REQUIRE(odd_g->l0_words % 64 != 0);
    uint64_t *odd_l1 = kva_slab_bitmap(sl, odd_chunk) + odd_g->l1_words - 1;
    CORRUPT("S2", *odd_l1, *odd_l1 | (uint64_t)1 << (odd_g->l0_words % 64)); /* a word past the last */
    uint32_t saved_length = b->pages[used].next;
    b->pages[used].next = 0; /* a head that would not move the walk on */
    expect_walk_refused(__LINE__);
    b->pages[used].next = saved_length;
    uint8_t saved_cls = sl->slabs[odd_chunk].cls;
    sl->slabs[odd_chunk].cls = 0xf0; /* a class past the table */
    expect_walk_refused(__LINE__);
    sl->slabs[odd_chunk].cls = saved_cls;
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CORRUPT("P4", sl->narenas, 100000u);              /* locking would take that many locks */
    CORRUPT("P4", sl->nchunks, sl->nchunks + 100000); /* walks would read past the descriptors */
    CORRUPT("P2", pool->capacity, pool->capacity + 4096);
    CORRUPT("P3", pool->block_allocs, pool->block_allocs + 1);

    /* B2: re-tile the 128 KiB block (order 5) at `used` as orders 0, 1, 0 at used, used+1,
     * used+3: still a tiling, but the order-1 head at an odd index is misaligned. */
    kva_page saved[4];
    memcpy(saved, &b->pages[used], sizeof saved);
    b->pages[used].order = 0;
    b->pages[used].next = 1;
    b->pages[used + 1] = (kva_page){.state = KVA_BLOCK_USED, .order = 1, .next = 2};
    b->pages[used + 3] = (kva_page){.state = KVA_BLOCK_USED, .order = 0, .next = 1};
    expect_broken("B2", __LINE__);
    memcpy(&b->pages[used], saved, sizeof saved);
    CHECK_STATUS(kva_check(pool), KVA_OK);

    /* B5: split a free block of order >= 1 into two free halves that were never merged. */
    uint64_t high = b->nonempty & ~(uint64_t)1;
    REQUIRE(high != 0);
    unsigned k = kva_ctz64(high);
    uint32_t f = b->free_head[k], half = (uint32_t)1 << (k - 1);
    kva_page saved_f = b->pages[f], saved_h = b->pages[f + half];
    b->pages[f].order = (uint8_t)(k - 1);
    b->pages[f + half] = (kva_page){.state = KVA_BLOCK_FREE, .order = (uint8_t)(k - 1)};
    expect_broken("B5", __LINE__);
    b->pages[f] = saved_f;
    b->pages[f + half] = saved_h;
    CHECK_STATUS(kva_check(pool), KVA_OK);

    /* Everything restored: the pool still works and checks clean. */
    for (int i = 0; i < 100; i++) CHECK_STATUS(kva_free(pool, objs[i]), KVA_OK);
    CHECK_STATUS(kva_free(pool, odd), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
    return CHECK_DONE();
}
