/*
 * pool_fingerprint.h — a pool's observable state in one value: a hash of its heap walk and its
 * stats (less the rejected-call counter, which a refused call is allowed to move). Tests take
 * one before a call that must change nothing and compare after it, together with kva_check.
 */
#ifndef KVA_TEST_POOL_FINGERPRINT_H
#define KVA_TEST_POOL_FINGERPRINT_H

#include <stdint.h>
#include <string.h>

#include "check.h"

/* A fingerprint of the pool's state: a hash of the heap walk plus the stats that must not move
 * (the rejected-call counter is allowed to). */
typedef struct snapshot {
    uint64_t walk_hash;
    kva_stats stats;
} snapshot;

static __attribute__((unused)) int hash_range(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    uint64_t *h = ctx;
    *h = (*h ^ offset) * 0x100000001b3ull;
    *h = (*h ^ size) * 0x100000001b3ull;
    *h = (*h ^ (uint64_t)kind) * 0x100000001b3ull;
    return 0;
}

static __attribute__((unused)) snapshot take(kva_pool *pool) {
    snapshot s;
    memset(&s, 0, sizeof s);
    s.walk_hash = 0xcbf29ce484222325ull;
    REQUIRE(kva_walk(pool, hash_range, &s.walk_hash) == KVA_OK);
    REQUIRE(kva_get_stats(pool, &s.stats) == KVA_OK);
    s.stats.rejected_calls = 0;
    return s;
}

static __attribute__((unused)) int unchanged(kva_pool *pool, const snapshot *before) {
    snapshot now = take(pool);
    return now.walk_hash == before->walk_hash && memcmp(&now.stats, &before->stats, sizeof now.stats) == 0 &&
           kva_check(pool) == KVA_OK;
}

#endif
