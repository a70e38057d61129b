/*
 * kv_admit.c — what admitting a prompt by its engine keys costs in C, per block, in a large
 * cache: the admission path alone, without a binding in front of it (docs/benchmarks.md, "Against
 * vLLM's own KV manager").
 *
 *     cc -O2 -std=c11 -I libkvalloc/include tools/experiments/kv_admit.c build/libkvalloc.a \
 *        -lpthread -ldl -o kv_admit && ./kv_admit [BLOCKS [PROMPT_BLOCKS]]
 *
 * A cache of BLOCKS blocks (default 1,760,079: every block of bench_engines' 2,000 Mooncake
 * requests) with 32-byte engine keys has every block registered once and evicted, so that its
 * metadata is in memory. Then 600 prompts of PROMPT_BLOCKS blocks (default 474) are admitted and
 * freed, each key new (every block committed), and again with the first half of each prompt's
 * keys as before (half the blocks hit). Prints ns per block of admission + free for each.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvalloc.h"

#define PROMPTS 600
#define KEY 32

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static uint64_t state = 88172645463325252u;

static uint64_t next(void) { /* xorshift64: the keys need only be distinct */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

static void fill(uint8_t *bytes, size_t n) {
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v = next();
        for (int j = 0; j < 8; j++) bytes[i + j] = (uint8_t)(v >> (8 * j));
    }
}

static void try(kva_status st, const char *what) {
    if (st != KVA_OK) {
        fprintf(stderr, "kv_admit: %s: %s\n", what, kva_last_error());
        exit(1);
    }
}

/* Admits and frees every prompt; ns per block, and the blocks that hit. */
static double run(kva_kv *kv, uint8_t *keys, uint32_t prompt, uint64_t *hit_blocks) {
    kva_kv_content content = {.kind = KVA_KV_KEY_BYTES, .key_len = KEY};
    uint64_t start = now_ns();
    for (uint32_t r = 0; r < PROMPTS; r++) {
        kva_kv_seq seq;
        uint32_t cached;
        content.key_bytes = keys + (size_t)r * prompt * KEY;
        try(kva_kv_seq_admit(kv, prompt * 16, 0, 0, &content, prompt, &seq, &cached), "admit");
        *hit_blocks += cached / 16;
        try(kva_kv_seq_free(kv, seq), "free");
    }
    return (double)(now_ns() - start) / ((double)PROMPTS * prompt);
}

int main(int argc, char **argv) {
    uint32_t blocks = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 10) : 1760079;
    uint32_t prompt = argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 10) : 474;
    if (blocks == 0 || prompt == 0 || prompt > blocks) {
        fprintf(stderr, "usage: %s [BLOCKS [PROMPT_BLOCKS]] (1 <= PROMPT_BLOCKS <= BLOCKS)\n", argv[0]);
        return 2;
    }
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = cfg.kv_heads = cfg.head_dim = cfg.dtype_bytes = 1;
    cfg.block_tokens = 16;
    cfg.num_blocks = blocks;
    cfg.max_key_bytes = KEY;
    kva_kv *kv;
    try(kva_kv_create(&cfg, NULL, &kv), "create");
    size_t warm = (size_t)blocks * KEY, all = (size_t)PROMPTS * prompt * KEY;
    uint8_t *keys = malloc(warm > all ? warm : all);
    if (!keys) return 1;
    fill(keys, warm);
    kva_kv_content content = {.kind = KVA_KV_KEY_BYTES, .key_len = KEY, .key_bytes = keys};
    kva_kv_seq seq;
    uint32_t cached;
    try(kva_kv_seq_admit(kv, blocks * 16, 0, 0, &content, blocks, &seq, &cached), "warm-up");
    try(kva_kv_seq_free(kv, seq), "warm-up free");
    try(kva_kv_evict(kv, blocks, NULL), "warm-up evict");
    fill(keys, all);
    uint64_t hits = 0;
    double fresh = run(kv, keys, prompt, &hits);
    for (uint32_t r = 0; r < PROMPTS; r++) /* the second half of each prompt new */
        fill(keys + ((size_t)r * prompt + prompt / 2) * KEY, (size_t)(prompt - prompt / 2) * KEY);
    double half = run(kv, keys, prompt, &hits);
    printf("| admission + free, %u blocks, prompts of %u | ns per block |\n|---|---:|\n", blocks, prompt);
    printf("| every block new | %.1f |\n| first half hits (%llu blocks hit) | %.1f |\n", fresh,
           (unsigned long long)hits, half);
    kva_kv_destroy(kv);
    free(keys);
    return 0;
}
