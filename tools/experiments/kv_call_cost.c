/*
 * kv_call_cost.c — the KV manager's calls in a loop, for callgrind: what a change adds to each
 * call in instructions, where a loaded machine's times cannot tell a few percent apart.
 *
 *     kv_call_cost PATTERN ROUNDS
 *
 * PATTERN: alloc_free (a 1-block sequence allocated and freed), append (a decode append of one
 * token), hit (a single-block prefix hit and its release), lookup (a 16-block chain looked up),
 * commit (4 new keys registered and, the cache full, 4 evicted), pin (a 4-block pin and unpin).
 * tools/run_kv_call_cost.sh runs each at two round counts under callgrind and takes the
 * difference, which leaves out the cache's creation: instructions per round.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvalloc.h"

#define BLOCK_TOKENS 16
#define BLOCKS 4096

static void try(kva_status st, const char *what) {
    if (st != KVA_OK) {
        fprintf(stderr, "kv_call_cost: %s: %s\n", what, kva_last_error());
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s alloc_free|append|hit|lookup|commit|pin|tenants ROUNDS\n", argv[0]);
        return 2;
    }
    const char *pattern = argv[1];
    long rounds = strtol(argv[2], NULL, 10);
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = 2;
    cfg.kv_heads = 2;
    cfg.head_dim = 64;
    cfg.block_tokens = BLOCK_TOKENS;
    cfg.num_blocks = BLOCKS;
    kva_kv *kv;
    try(kva_kv_create(&cfg, NULL, &kv), "create");
    uint64_t keys[16];
    for (int i = 0; i < 16; i++) keys[i] = 1000 + (uint64_t)i;
    kva_kv_seq seq;
    kva_kv_copy copy;
    uint32_t hits, ids[16];
    /* Registered, then cached: what hit and lookup find. */
    try(kva_kv_seq_allocate(kv, 16 * BLOCK_TOKENS, keys, 16, NULL, 0, 0, 0, &seq, NULL), "allocate");
    try(kva_kv_seq_free(kv, seq), "free");
    kva_kv_content content = {.kind = KVA_KV_KEY_U64, .keys = keys};
    if (strcmp(pattern, "append") == 0) {
        try(kva_kv_seq_allocate(kv, 1, NULL, 0, NULL, 0, 0, 0, &seq, NULL), "allocate");
        for (long i = 0; i < rounds; i++) {
            if (i % ((BLOCKS - 32) * BLOCK_TOKENS) == 0 && i) { /* start over before the cache fills */
                try(kva_kv_seq_free(kv, seq), "free");
                try(kva_kv_seq_allocate(kv, 1, NULL, 0, NULL, 0, 0, 0, &seq, NULL), "allocate");
            }
            try(kva_kv_seq_append(kv, seq, 1, &copy), "append");
        }
    } else if (strcmp(pattern, "alloc_free") == 0) {
        for (long i = 0; i < rounds; i++) {
            try(kva_kv_seq_allocate(kv, BLOCK_TOKENS, NULL, 0, NULL, 0, 0, 0, &seq, NULL), "allocate");
            try(kva_kv_seq_free(kv, seq), "free");
        }
    } else if (strcmp(pattern, "hit") == 0) {
        for (long i = 0; i < rounds; i++) {
            try(kva_kv_seq_allocate(kv, BLOCK_TOKENS, keys, 1, NULL, 0, 0, 0, &seq, &hits), "allocate");
            try(kva_kv_seq_free(kv, seq), "free");
        }
    } else if (strcmp(pattern, "commit") == 0) {
        /* 4 new keys a round, registered, then cached at the free; once the cache is full each
         * round evicts 4: registrations and their drops in steady state. */
        uint64_t fresh[4];
        for (long i = 0; i < rounds; i++) {
            for (int j = 0; j < 4; j++) fresh[j] = ((uint64_t)1 << 40) + (uint64_t)i * 4 + (uint64_t)j;
            try(kva_kv_seq_allocate(kv, 4 * BLOCK_TOKENS, fresh, 4, NULL, 0, (uint32_t)(i % 3), 0, &seq, NULL),
                "allocate");
            try(kva_kv_seq_free(kv, seq), "free");
        }
    } else if (strcmp(pattern, "tenants") == 0) {
        /* commit's round in a namespace past the 32 tracked ones: 40 tenants each hold a
         * sequence, so every slot is taken and the other row counts the last 8; the rounds
         * alternate between two of those. */
        kva_kv_seq tenant[40];
        for (uint32_t t = 0; t < 40; t++)
            try(kva_kv_seq_allocate(kv, BLOCK_TOKENS, NULL, 0, NULL, 0, 100 + t, 0, &tenant[t], NULL), "allocate");
        uint64_t fresh[4];
        for (long i = 0; i < rounds; i++) {
            for (int j = 0; j < 4; j++) fresh[j] = ((uint64_t)1 << 40) + (uint64_t)i * 4 + (uint64_t)j;
            try(kva_kv_seq_allocate(kv, 4 * BLOCK_TOKENS, fresh, 4, NULL, 0, 138 + (uint32_t)(i % 2), 0, &seq, NULL),
                "allocate");
            try(kva_kv_seq_free(kv, seq), "free");
        }
        for (uint32_t t = 0; t < 40; t++) try(kva_kv_seq_free(kv, tenant[t]), "free");
    } else if (strcmp(pattern, "pin") == 0) {
        for (long i = 0; i < rounds; i++) {
            try(kva_kv_pin(kv, keys, 4, NULL, 0, 0, &seq, &hits), "pin");
            try(kva_kv_unpin(kv, seq), "unpin");
        }
    } else if (strcmp(pattern, "lookup") == 0) {
        for (long i = 0; i < rounds; i++) try(kva_kv_lookup(kv, 0, &content, 16, ids, &hits), "lookup");
    } else {
        fprintf(stderr, "kv_call_cost: no pattern %s\n", pattern);
        return 2;
    }
    kva_kv_destroy(kv);
    return 0;
}
