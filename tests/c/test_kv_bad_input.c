/*
 * test_kv_bad_input.c — every kind of bad input to the KV-cache manager returns its own status,
 * leaves the out-parameters untouched and the cache exactly as it was (same statistics but the
 * failure counters, same block tables, kva_kv_check passing).
 */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "kv_cache.h"
#include "kv_test.h"

#define SENTINEL_SEQ ((kva_kv_seq)0x5e5e5e5e5e5e5e5eull)
#define SENTINEL_U32 0x5e5e5e5eu

/* The cache's visible state: its statistics (less the failure counters) and the tables of the
 * sequences the test holds. */
typedef struct snapshot {
    kva_kv_stats stats;
    uint64_t tables_hash;
} snapshot;

static kva_kv_seq held[8];
static int nheld;

static snapshot take(kva_kv *kv) {
    snapshot s;
    memset(&s, 0, sizeof s);
    s.stats = stats(kv);
    s.stats.rejected_calls = s.stats.alloc_failures = 0;
    s.stats.metadata_bytes = 0; /* a failed call may keep a grown slot array or table for later */
    /* every call may be timed, a failed one too: its latency is no state of the cache */
    s.stats.timed_calls = s.stats.timed_ns = 0;
    memset(s.stats.call_ns_log2, 0, sizeof s.stats.call_ns_log2);
    memset(s.stats.kind_timed_calls, 0, sizeof s.stats.kind_timed_calls);
    memset(s.stats.kind_timed_ns, 0, sizeof s.stats.kind_timed_ns);
    memset(s.stats.kind_ns_log2, 0, sizeof s.stats.kind_ns_log2);
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < nheld; i++) {
        const uint32_t *table;
        uint32_t len;
        kva_kv_seq_info si;
        REQUIRE(kva_kv_seq_block_table(kv, held[i], &table, &len) == KVA_OK);
        REQUIRE(kva_kv_seq_get_info(kv, held[i], &si) == KVA_OK);
        h = (h ^ len ^ (uint64_t)si.num_tokens << 32) * 0x100000001b3ull;
        for (uint32_t j = 0; j < len; j++) h = (h ^ table[j]) * 0x100000001b3ull;
    }
    s.tables_hash = h;
    return s;
}

static int unchanged(kva_kv *kv, const snapshot *before) {
    snapshot now = take(kv);
    return memcmp(&now, before, sizeof now) == 0 && kva_kv_check(kv) == KVA_OK;
}

static void test_bad_configs(void) {
    kva_kv_config base = small_config(16, 4);
    kva_kv *kv = SENTINEL_KV;
    CHECK_STATUS(kva_kv_create(NULL, NULL, &kv), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_create(&base, NULL, NULL), KVA_ERR_INVALID);
    size_t bytes = 7;
    CHECK_STATUS(kva_kv_block_bytes(NULL, &bytes), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_bytes(&base, NULL), KVA_ERR_INVALID);
    CHECK(bytes == 7);

    for (int field = 0; field < 18; field++) {
        kva_kv_config cfg = base;
        kva_status expect = KVA_ERR_INVALID;
        switch (field) {
        case 0: cfg.layers = 0; break;
        case 1: cfg.kv_heads = 0; break;
        case 2: cfg.head_dim = 0; break;
        case 3: cfg.block_tokens = 0; break;
        case 4: cfg.dtype_bytes = 0; break;
        case 5: cfg.dtype_bytes = 3; break; /* no such dtype */
        case 6: cfg.dtype_bytes = 16; break;
        case 7: cfg.mode = (kva_kv_mode)7; break;
        case 8: cfg.layout = (kva_kv_layout)9; break;
        case 9:
            cfg.num_blocks = 0;
            cfg.capacity_bytes = 0;
            break;
        case 10:
            cfg.num_blocks = 0;
            cfg.capacity_bytes = 100;
            break; /* less than one block */
        case 11: cfg.num_blocks = (1u << 30) + 1; break;
        case 12: cfg.layers = cfg.kv_heads = cfg.head_dim = 1u << 31; break; /* bytes overflow */
        case 13:
            cfg.mode = KVA_KV_CONTIGUOUS;
            cfg.max_context = 100;
            break;
        case 14:
            cfg.mode = KVA_KV_CONTIGUOUS;
            cfg.max_context = 32;
            break;
        case 15:
            cfg.mode = KVA_KV_CONTIGUOUS;
            cfg.num_blocks = 0;
            cfg.capacity_bytes = 1000;
            break;
        case 16: /* a bucket of max_context tokens larger than the whole pool */
            cfg.mode = KVA_KV_CONTIGUOUS;
            cfg.max_context = 1 << 20;
            expect = KVA_ERR_NOMEM;
            break;
        case 17: /* 7 blocks of 2^61 bytes: no overflow, but more than any pool holds */
            cfg.layers = cfg.kv_heads = 1u << 20;
            cfg.head_dim = 1u << 17;
            cfg.num_blocks = 7;
            break;
        }
        kv = SENTINEL_KV;
        kva_status got = kva_kv_create(&cfg, NULL, &kv);
        if (got != expect) fprintf(stderr, "config case %d: got %d (%s)\n", field, (int)got, kva_last_error());
        CHECK(got == expect);
        CHECK(kv == SENTINEL_KV);
        CHECK(kva_last_error()[0] != '\0');
        CHECK(strstr(kva_last_error(), "min_block") == NULL); /* not a field the caller set */
        if (field == 9) CHECK(strstr(kva_last_error(), "no size given: set num_blocks, or capacity_bytes") != NULL);
        if (field == 10) CHECK(strstr(kva_last_error(), "capacity_bytes 100 holds no block") != NULL);
        if (field <= 6 || field == 12) {
            bytes = 7;
            CHECK_STATUS(kva_kv_block_bytes(&cfg, &bytes), KVA_ERR_INVALID);
            CHECK(bytes == 7);
        }
    }
}

/* Every call refuses a NULL cache. */
static void test_null_cache(void) {
    kva_kv_seq seq = SENTINEL_SEQ;
    kva_kv_copy copy;
    const uint32_t *table;
    uint32_t len;
    kva_kv_info info;
    kva_kv_stats st;
    kva_kv_seq_info si;
    void *at;
    CHECK_STATUS(kva_kv_seq_allocate(NULL, 4, NULL, 0, NULL, 0, 0, 0, &seq, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_append(NULL, 1, 1, &copy), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_fork(NULL, 1, &seq), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_free(NULL, 1), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_block_table(NULL, 1, &table, &len), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_seq_get_info(NULL, 1, &si), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_pin(NULL, NULL, 0, NULL, 0, 0, &seq, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_unpin(NULL, 1), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_evict(NULL, 1, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_get_info(NULL, &info), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_get_stats(NULL, &st), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_check(NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_address(NULL, 0, 0, KVA_KV_K, &at), KVA_ERR_INVALID);
    CHECK(seq == SENTINEL_SEQ);
    kva_kv_destroy(NULL); /* tolerated */
}

static void test_bad_sequence_calls(void) {
    kva_kv_config cfg = small_config(12, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {1, 2, 3};
    uint32_t cached;
    nheld = 0;
    held[nheld++] = alloc_keys(kv, 10, keys, 2, 0, 0, &cached); /* 3 blocks, last partial */
    kva_kv_seq child;
    REQUIRE(kva_kv_seq_fork(kv, held[0], &child) == KVA_OK);
    held[nheld++] = child;
    kva_kv_seq gone = alloc_keys(kv, 8, keys + 1, 2, 0, 0, &cached);
    REQUIRE(kva_kv_seq_free(kv, gone) == KVA_OK); /* two blocks cached, a stale handle */
    snapshot before = take(kv);
    CHECK(before.stats.used_blocks == 3 && before.stats.cached_blocks == 2 && before.stats.free_blocks == 7);

    kva_kv_seq seq = SENTINEL_SEQ;
    uint32_t out = SENTINEL_U32;
    kva_kv_copy copy;
    memset(&copy, 0x5e, sizeof copy);
    kva_kv_copy untouched = copy;
    uint32_t tokens[16] = {0};
    kva_kv_seq never = (kva_kv_seq)1 << 32 | 999, future = held[0] + ((kva_kv_seq)5 << 32);
#define REFUSED(call, status)                                                                             \
    do {                                                                                                  \
        CHECK_STATUS(call, status);                                                                       \
        CHECK(unchanged(kv, &before));                                                                    \
        CHECK(seq == SENTINEL_SEQ && out == SENTINEL_U32 && memcmp(&copy, &untouched, sizeof copy) == 0); \
    } while (0)

    /* allocation */
    REFUSED(kva_kv_seq_allocate(kv, 4, NULL, 0, NULL, 0, 0, 0, NULL, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_allocate(kv, 4, NULL, 0, NULL, 0, 0, KVA_KV_PRIORITIES, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_allocate(kv, 8, NULL, 2, NULL, 0, 0, 0, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_allocate(kv, 8, NULL, 0, NULL, 3, 0, 0, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_allocate(kv, 8, keys, 1, tokens, 4, 0, 0, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_allocate(kv, 7, keys, 2, NULL, 0, 0, 0, &seq, &out), KVA_ERR_INVALID); /* 1 full block */
    REFUSED(kva_kv_seq_allocate(kv, 7, NULL, 0, tokens, 8, 0, 0, &seq, &out), KVA_ERR_INVALID);
    /* Too big: for the cache as a whole, and for what is free and evictable (9) now; a request
     * whose hits are evictable blocks does not count them twice. */
    REFUSED(kva_kv_seq_allocate(kv, 13 * 4, NULL, 0, NULL, 0, 0, 0, &seq, &out), KVA_ERR_NOMEM);
    REFUSED(kva_kv_seq_allocate(kv, 10 * 4, NULL, 0, NULL, 0, 0, 0, &seq, &out), KVA_ERR_NOMEM);
    uint64_t evictable_hit[] = {2, 3};
    REFUSED(kva_kv_seq_allocate(kv, 10 * 4, evictable_hit, 2, NULL, 0, 0, 0, &seq, &out), KVA_ERR_NOMEM);

    /* append: unknown, stale, NULL copy, too long, too big (with a pending copy on write) */
    REFUSED(kva_kv_seq_append(kv, 0, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_append(kv, never, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_append(kv, future, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_append(kv, gone, 1, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_append(kv, held[0], 1, NULL), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_append(kv, held[0], UINT32_MAX, &copy), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_append(kv, held[1], 9 * 4 - 1, &copy), KVA_ERR_NOMEM); /* 9 new + 1 copy > 9 */
    REFUSED(kva_kv_seq_append(kv, held[1], 100, &copy), KVA_ERR_NOMEM);

    /* fork, free, tables, info */
    REFUSED(kva_kv_seq_fork(kv, gone, &seq), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_fork(kv, never, &seq), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_fork(kv, held[0], NULL), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_free(kv, gone), KVA_ERR_DOUBLE_FREE);
    REFUSED(kva_kv_seq_free(kv, never), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_free(kv, future), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_free(kv, 0), KVA_ERR_INVALID);
    REFUSED(kva_kv_unpin(kv, held[0]), KVA_ERR_INVALID);
    const uint32_t *table = (const uint32_t *)0x5e;
    uint32_t len = SENTINEL_U32;
    REFUSED(kva_kv_seq_block_table(kv, gone, &table, &len), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_block_table(kv, held[0], NULL, &len), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_block_table(kv, held[0], &table, NULL), KVA_ERR_INVALID);
    CHECK(table == (const uint32_t *)0x5e && len == SENTINEL_U32);
    kva_kv_seq_info si;
    memset(&si, 0x5e, sizeof si);
    REFUSED(kva_kv_seq_get_info(kv, gone, &si), KVA_ERR_INVALID);
    REFUSED(kva_kv_seq_get_info(kv, held[0], NULL), KVA_ERR_INVALID);
    CHECK(si.num_tokens == SENTINEL_U32);

    /* pins */
    REFUSED(kva_kv_pin(kv, keys, 2, NULL, 0, 0, NULL, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_pin(kv, NULL, 2, NULL, 0, 0, &seq, &out), KVA_ERR_INVALID);
    REFUSED(kva_kv_pin(kv, keys, 2, tokens, 4, 0, &seq, &out), KVA_ERR_INVALID);

    /* addresses */
    void *at = (void *)0x5e;
    CHECK_STATUS(kva_kv_block_address(kv, 12, 0, KVA_KV_K, &at), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_address(kv, 0, 3, KVA_KV_K, &at), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_address(kv, 0, 0, (kva_kv_part)2, &at), KVA_ERR_INVALID);
    CHECK_STATUS(kva_kv_block_address(kv, 0, 0, KVA_KV_V, NULL), KVA_ERR_INVALID);
    CHECK(at == (void *)0x5e);
    CHECK(unchanged(kv, &before));
#undef REFUSED

    /* The refusals were counted, and the cache still works. */
    kva_kv_stats st = stats(kv);
    CHECK(st.rejected_calls == 29 && st.alloc_failures == 5); /* addresses take no lock, count nothing */
    kva_kv_copy ok;
    CHECK_STATUS(kva_kv_seq_append(kv, held[1], 1, &ok), KVA_OK);
    CHECK(ok.tokens == 2); /* the copy on write, done once the append fits */
    for (int i = 0; i < nheld; i++) CHECK_STATUS(kva_kv_seq_free(kv, held[i]), KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* A handle of one cache is refused by another, even where both caches gave the same slot and
 * generation: every call that takes a handle says KVA_ERR_INVALID and changes nothing. */
static void test_handles_of_another_cache(void) {
    kva_kv_config cfg = small_config(12, 4);
    kva_kv *kv = make_cache(&cfg), *other = make_cache(&cfg);
    nheld = 0;
    kva_kv_seq gone = alloc_plain(kv, 4), theirs_gone = alloc_plain(other, 4);
    REQUIRE(kva_kv_seq_free(kv, gone) == KVA_OK && kva_kv_seq_free(other, theirs_gone) == KVA_OK);
    held[nheld++] = alloc_plain(kv, 8); /* the same slot and generation in both caches */
    kva_kv_seq theirs = alloc_plain(other, 8);
    uint64_t key = 7;
    kva_kv_seq their_pin;
    uint32_t blocks;
    REQUIRE(kva_kv_pin(other, &key, 1, NULL, 0, 0, &their_pin, &blocks) == KVA_OK);
    snapshot before = take(kv);
    kva_kv_seq foreign[] = {theirs, theirs_gone, their_pin};
    for (unsigned i = 0; i < sizeof foreign / sizeof foreign[0]; i++) {
        kva_kv_copy copy;
        kva_kv_seq child;
        const uint32_t *table;
        uint32_t len;
        kva_kv_seq_info si;
        CHECK_STATUS(kva_kv_seq_append(kv, foreign[i], 1, &copy), KVA_ERR_INVALID);
        CHECK_STATUS(kva_kv_seq_fork(kv, foreign[i], &child), KVA_ERR_INVALID);
        CHECK_STATUS(kva_kv_seq_block_table(kv, foreign[i], &table, &len), KVA_ERR_INVALID);
        CHECK_STATUS(kva_kv_seq_get_info(kv, foreign[i], &si), KVA_ERR_INVALID);
        CHECK_STATUS(kva_kv_seq_free(kv, foreign[i]), KVA_ERR_INVALID);
        CHECK_STATUS(kva_kv_unpin(kv, foreign[i]), KVA_ERR_INVALID);
        CHECK(unchanged(kv, &before));
    }
    CHECK_STATUS(kva_kv_seq_free(other, theirs), KVA_OK); /* their own cache still takes them */
    CHECK_STATUS(kva_kv_unpin(other, their_pin), KVA_OK);
    CHECK_STATUS(kva_kv_seq_free(kv, held[0]), KVA_OK);
    kva_kv_destroy(kv);
    kva_kv_destroy(other);

    /* The bound kv_slots.c states: the first 4,096 caches' keys differ pairwise by at least
     * 744,616, so no handle of one decodes to a slot below that in another. */
    uint32_t least = UINT32_MAX;
    for (uint32_t a = 1; a <= 4096; a++)
        for (uint32_t b = a + 1; b <= 4096; b++) {
            uint32_t d = kv_handle_key(a) ^ kv_handle_key(b);
            if (d < least) least = d;
        }
    CHECK(least == 744616);
}

/* kva_kv_check names a broken invariant instead of passing; the test plays the bug. */
static void test_check_finds_corruption(void) {
    kva_kv_config cfg = small_config(8, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {1, 2};
    uint32_t cached;
    kva_kv_seq s = alloc_keys(kv, 8, keys, 2, 0, 0, &cached);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kv->blocks[0].refs++;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "K2") != NULL);
    kv->blocks[0].refs--;
    kv->free_count++;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "K1") != NULL);
    kv->free_count--;
    kv->blocks[1].key.lo ^= 1;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    kv->blocks[1].key.lo ^= 1;
    REQUIRE(kva_kv_seq_free(kv, s) == KVA_OK);
    kv->lru_count[0]++;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "K4") != NULL);
    kv->lru_count[0]--;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_destroy(kv);
}

/* A prefix chain that loops away from its first block, or links past the table, is named
 * (the duplicate-key scan under each block followed such links unbounded: it hung, or read
 * past the block records). */
static void test_check_survives_broken_chains(void) {
    kva_kv_config cfg = small_config(64, 4);
    kva_kv *kv = make_cache(&cfg);
    uint64_t keys[] = {1, 2, 3};
    uint32_t cached;
    kva_kv_seq s = alloc_keys(kv, 12, keys, 3, 0, 0, &cached);
    const uint32_t *table;
    uint32_t len;
    REQUIRE(kva_kv_seq_block_table(kv, s, &table, &len) == KVA_OK && len == 3);
    uint32_t x = table[0], y = table[1], saved_x = kv->blocks[x].hash_next, saved_y = kv->blocks[y].hash_next;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kv->blocks[x].hash_next = y; /* x's chain runs on into y, whose next is itself */
    kv->blocks[y].hash_next = y;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "K5") != NULL);
    kv->blocks[x].hash_next = 0x40000000u;
    kv->blocks[y].hash_next = saved_y;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "past the end") != NULL);
    kv->blocks[x].hash_next = x;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "loops back") != NULL);
    kv->blocks[x].hash_next = saved_x;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    REQUIRE(kva_kv_seq_free(kv, s) == KVA_OK);
    kva_kv_destroy(kv);
}

/* Contiguous mode: two sequences naming one buffer are named, though their sizes still add up
 * to the counter. */
static void test_check_finds_a_shared_buffer(void) {
    kva_kv_config cfg = small_config(0, 16);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.max_context = 1024;
    cfg.capacity_bytes = (size_t)8 << 20;
    kva_kv *kv = make_cache(&cfg);
    kva_kv_seq a, b;
    REQUIRE(kva_kv_seq_allocate(kv, 100, NULL, 0, NULL, 0, 0, 0, &a, NULL) == KVA_OK);
    REQUIRE(kva_kv_seq_allocate(kv, 100, NULL, 0, NULL, 0, 0, 0, &b, NULL) == KVA_OK);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    kva_kv_seqrec *first = NULL, *second = NULL;
    for (uint32_t slot = 0; slot < kv->seq_slots; slot++)
        if (kv->seqs[slot].live) *(first ? &second : &first) = &kv->seqs[slot];
    REQUIRE(first && second);
    unsigned char *saved = second->buffer;
    second->buffer = first->buffer;
    CHECK_STATUS(kva_kv_check(kv), KVA_ERR_CORRUPT);
    CHECK(strstr(kva_last_error(), "belongs to two sequences") != NULL);
    second->buffer = saved;
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    REQUIRE(kva_kv_seq_free(kv, a) == KVA_OK && kva_kv_seq_free(kv, b) == KVA_OK);
    kva_kv_destroy(kv);
}

int main(void) {
    hang_guard("test_kv_bad_input", 2 * HANG_GUARD_SECONDS); /* a checker that loops fails the test */
    test_check_survives_broken_chains();
    test_check_finds_a_shared_buffer();
    test_bad_configs();
    test_null_cache();
    test_bad_sequence_calls();
    test_handles_of_another_cache();
    test_check_finds_corruption();
    return CHECK_DONE();
}
