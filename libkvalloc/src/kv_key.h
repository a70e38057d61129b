/*
 * kv_key.h — the 128-bit keys of the prefix cache.
 *
 * A full block's key names its content and everything before it:
 *     key_0 = chain(root(seed), digest_0, ns),   key_i = chain(key_{i-1}, digest_i, ns)
 * where digest_i is 128 bits standing for the block's content: its token ids hashed here, or the
 * caller's 64-bit block key (a trace's hash id) with a fixed domain word beside it, and ns is the
 * 64-bit namespace. Equal keys therefore mean equal namespaces and equal contents all the way
 * from the first block, up to a collision. The prefix table compares the namespace exactly as
 * well, so different namespaces never share a block, collision or not.
 *
 * Engine keys. An engine that hashes its blocks itself (vLLM's 32-byte sha256 or 16-byte xxh3
 * digests, already chained over the parent; SGLang's sha256) gives the key as 1 to 32 bytes. It
 * is not chained again: the engine's bytes are the identity, stored exactly beside the block
 * (kv_cache.h, key_store), and two registered keys are equal only when their namespaces, lengths
 * and bytes are. The 128-bit fingerprint of the bytes (kv_key_engine) picks the prefix-table
 * bucket and rules most other keys out with one compare; it never decides equality alone, so
 * two distinct engine keys never alias, whatever the fingerprint does.
 *
 * Each key is two 64-bit lanes computed by different functions of the same input: different
 * multipliers, shifts, word orders, and xor against add for absorbing. An absorb step is a
 * bijection of the lane for a fixed word and of the word for a fixed lane, so a chain loses
 * nothing; the finish step spreads every input bit across its lane. Taking the pair as a
 * random 128-bit value, n distinct prefixes contain a colliding pair with probability about
 * n^2 / 2^129: under 2^-60 after 2^34 blocks have been keyed. With caller keys, content
 * identity is the caller's 64-bit key (two contents the caller gives one key are one content);
 * the chain adds no collision of its own beyond the 128-bit figure.
 *
 * The functions are not cryptographic. A client who chooses token ids to force a collision can
 * be kept away from other tenants' KV by giving each tenant its own namespace (compared
 * exactly), and can be kept from precomputing keys by a secret random hash_seed.
 *
 * Cost: a chain step is three absorbs and one finish per lane, the lanes independent, about
 * 25 cycles of latency; a digest of 16 token ids is eight absorbs per lane.
 */
#ifndef KVA_KV_KEY_H
#define KVA_KV_KEY_H

#include <string.h>

#include "internal.h"

typedef struct kva_kv_key {
    uint64_t lo, hi;
} kva_kv_key;

/* Odd multipliers with about half their bits set, drawn at random for this library. */
#define KV_MUL_A 0xd1a6e55e9b9b1325ull
#define KV_MUL_B 0xcf0c26ef4243ed53ull
#define KV_FIN_A1 0x5e6a0a2edd70e34dull
#define KV_FIN_A2 0xb37523a53b4a3ee3ull
#define KV_FIN_B1 0x4de45321ad915a37ull
#define KV_FIN_B2 0x9823beb1e6ba3ad7ull
/* Domain words: a caller key's digest, a token digest's start, the root, an engine key. */
#define KV_DOMAIN_CALLER 0xaed09b824ca87fc3ull
#define KV_DOMAIN_TOKENS 0x1ff135342e825ce1ull
#define KV_DOMAIN_ROOT 0x33f5f28807f0cbd5ull
#define KV_DOMAIN_ENGINE 0x8c1b5e3f6a0d2d79ull

KVA_INLINE uint64_t kv_rotl(uint64_t x, unsigned r) { return (x << r) | (x >> (64 - r)); }

KVA_INLINE uint64_t kv_absorb_a(uint64_t h, uint64_t w) {
    h = (h ^ w) * KV_MUL_A;
    return h ^ (h >> 29);
}

KVA_INLINE uint64_t kv_absorb_b(uint64_t h, uint64_t w) {
    h = (h + kv_rotl(w, 32)) * KV_MUL_B;
    return h ^ (h >> 31);
}

KVA_INLINE uint64_t kv_finish(uint64_t h, uint64_t m1, uint64_t m2) {
    h ^= h >> 32;
    h *= m1;
    h ^= h >> 29;
    h *= m2;
    return h ^ (h >> 32);
}

/* The parent of every sequence's first block. */
KVA_INLINE kva_kv_key kv_key_root(uint64_t seed) {
    return (kva_kv_key){kv_finish(seed ^ KV_DOMAIN_ROOT, KV_FIN_A1, KV_FIN_A2),
                        kv_finish(kv_rotl(seed, 17) + KV_DOMAIN_ROOT, KV_FIN_B1, KV_FIN_B2)};
}

/* The key of a block whose parent has key `parent`. */
KVA_INLINE kva_kv_key kv_key_chain(kva_kv_key parent, kva_kv_key digest, uint64_t ns) {
    uint64_t a = kv_absorb_a(kv_absorb_a(kv_absorb_a(parent.lo, digest.lo), digest.hi), parent.hi ^ ns);
    uint64_t b = kv_absorb_b(kv_absorb_b(kv_absorb_b(parent.hi, digest.hi), digest.lo), parent.lo + ns);
    return (kva_kv_key){kv_finish(a, KV_FIN_A1, KV_FIN_A2), kv_finish(b, KV_FIN_B1, KV_FIN_B2)};
}

/* The digest of a caller's 64-bit block key. */
KVA_INLINE kva_kv_key kv_digest_caller(uint64_t key) { return (kva_kv_key){key, KV_DOMAIN_CALLER}; }

/* The digest of one block's n token ids (n >= 1). */
KVA_INLINE kva_kv_key kv_digest_tokens(const uint32_t *tokens, uint32_t n) {
    uint64_t a = KV_DOMAIN_TOKENS ^ n, b = ~KV_DOMAIN_TOKENS + n;
    uint32_t i = 0;
    for (; i + 2 <= n; i += 2) {
        uint64_t w = (uint64_t)tokens[i] | (uint64_t)tokens[i + 1] << 32;
        a = kv_absorb_a(a, w);
        b = kv_absorb_b(b, w);
    }
    if (i < n) {
        a = kv_absorb_a(a, tokens[i]);
        b = kv_absorb_b(b, tokens[i]);
    }
    return (kva_kv_key){kv_finish(a, KV_FIN_A1, KV_FIN_A2), kv_finish(b, KV_FIN_B1, KV_FIN_B2)};
}

/* The fingerprint of an engine's key of len bytes (1 .. KVA_KV_MAX_KEY_BYTES) in namespace ns,
 * seeded by the cache's root so that a client cannot aim keys at one bucket. */
KVA_INLINE kva_kv_key kv_key_engine(kva_kv_key root, uint64_t ns, const uint8_t *bytes, uint32_t len) {
    uint64_t a = kv_absorb_a(root.lo ^ KV_DOMAIN_ENGINE ^ len, ns),
             b = kv_absorb_b(root.hi + KV_DOMAIN_ENGINE + len, ns);
    for (uint32_t i = 0; i < len; i += 8) {
        uint64_t w = 0;
        memcpy(&w, bytes + i, len - i < 8 ? len - i : 8);
        a = kv_absorb_a(a, w);
        b = kv_absorb_b(b, w);
    }
    return (kva_kv_key){kv_finish(a, KV_FIN_A1, KV_FIN_A2), kv_finish(b, KV_FIN_B1, KV_FIN_B2)};
}

KVA_INLINE int kv_key_equal(kva_kv_key x, kva_kv_key y) { return x.lo == y.lo && x.hi == y.hi; }

#endif
