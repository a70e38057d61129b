/*
 * fuzz_kv.c — libFuzzer harness for the KV-cache manager: input bytes become allocations with
 * prefix keys drawn from a small alphabet (so prefixes are shared), appends, forks, frees, pins,
 * evictions and stale-handle calls on a small paged cache. kva_kv_check after every operation is
 * the oracle, with the model of which handles are live: a live handle must work (or report
 * out of memory), a freed one must be refused, the block counts must add up.
 */
#include <stdint.h>
#include <string.h>

#include "fuzz_input.h"
#include "kvalloc.h"

#define MAX_SEQS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input in = {data, size, 0};
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = 1, cfg.kv_heads = 1, cfg.head_dim = 8, cfg.block_tokens = 4;
    cfg.num_blocks = 32 + next_byte(&in) % 32;
    cfg.layout = next_byte(&in) & 1 ? KVA_KV_LAYOUT_BLOCKS : KVA_KV_LAYOUT_LAYERS;
    cfg.pages = KVA_PAGES_SMALL;
    kva_kv *kv;
    ORACLE(kva_kv_create(&cfg, NULL, &kv) == KVA_OK);
    kva_kv_seq live[MAX_SEQS], dead[MAX_SEQS];
    int is_pin[MAX_SEQS];
    size_t nlive = 0, ndead = 0;

    while (in.at < in.size) {
        unsigned op = next_byte(&in) % 8;
        kva_status st;
        if (op <= 1 && nlive < MAX_SEQS) {
            /* A prompt whose full blocks are keyed from a 4-letter alphabet: prefixes repeat. */
            uint32_t tokens = next_byte(&in) % 40 + 1, full = tokens / 4, nkeys = next_byte(&in) % (full + 1);
            uint64_t keys[16];
            for (uint32_t i = 0; i < nkeys && i < 16; i++) keys[i] = next_byte(&in) % 4;
            if (nkeys > 16) nkeys = 16;
            kva_kv_seq seq;
            uint32_t cached = UINT32_MAX;
            if (op == 0) {
                st = kva_kv_seq_allocate(kv, tokens, nkeys ? keys : NULL, nkeys, NULL, 0, next_byte(&in) % 2,
                                         next_byte(&in) % KVA_KV_PRIORITIES, &seq, &cached);
                ORACLE(st == KVA_OK || st == KVA_ERR_NOMEM);
                if (st == KVA_OK) ORACLE(cached <= tokens && cached % 4 == 0);
            } else {
                st = kva_kv_pin(kv, nkeys ? keys : NULL, nkeys, NULL, 0, 0, &seq, &cached);
                ORACLE(st == KVA_OK || st == KVA_ERR_NOMEM || st == KVA_ERR_INVALID);
            }
            if (st == KVA_OK) {
                is_pin[nlive] = op == 1;
                live[nlive++] = seq;
            }
        } else if (op == 2 && nlive) {
            size_t i = next_byte(&in) % nlive;
            kva_kv_copy copy;
            st = kva_kv_seq_append(kv, live[i], next_byte(&in) % 9 + 1, &copy);
            ORACLE(is_pin[i] ? st == KVA_ERR_INVALID : (st == KVA_OK || st == KVA_ERR_NOMEM));
        } else if (op == 3 && nlive && nlive < MAX_SEQS) {
            size_t i = next_byte(&in) % nlive;
            kva_kv_seq child;
            st = kva_kv_seq_fork(kv, live[i], &child);
            ORACLE(is_pin[i] ? st == KVA_ERR_INVALID : st == KVA_OK);
            if (st == KVA_OK) {
                is_pin[nlive] = 0;
                live[nlive++] = child;
            }
        } else if (op <= 5 && nlive) {
            size_t i = next_byte(&in) % nlive;
            st = is_pin[i] ? kva_kv_unpin(kv, live[i]) : kva_kv_seq_free(kv, live[i]);
            ORACLE(st == KVA_OK);
            if (ndead < MAX_SEQS) dead[ndead++] = live[i];
            live[i] = live[--nlive];
            is_pin[i] = is_pin[nlive];
        } else if (op == 6 && ndead) {
            /* A stale handle: refused, nothing changes. */
            kva_kv_stats before, after;
            kva_kv_get_stats(kv, &before);
            kva_kv_copy copy;
            kva_kv_seq stale = dead[next_byte(&in) % ndead];
            ORACLE(kva_kv_seq_free(kv, stale) != KVA_OK);
            ORACLE(kva_kv_seq_append(kv, stale, 1, &copy) != KVA_OK);
            kva_kv_get_stats(kv, &after);
            ORACLE(after.used_blocks == before.used_blocks && after.free_blocks == before.free_blocks);
        } else if (op == 7 && next_byte(&in) % 2 == 0) {
            uint32_t evicted;
            ORACLE(kva_kv_evict(kv, next_byte(&in) % 8, &evicted) == KVA_OK);
        } else if (op == 7) {
            /* Compaction (every move an id from the top to a hole below), then a trim: the
             * trimmed blocks are exactly the free ones above the data. */
            kva_kv_move moves[64];
            uint32_t count = 0, trimmed = 0;
            ORACLE(kva_kv_compact(kv, moves, 64, &count) == KVA_OK);
            for (uint32_t m = 0; m < count; m++) ORACLE(moves[m].dst_block < moves[m].src_block);
            kva_kv_stats before;
            kva_kv_get_stats(kv, &before);
            ORACLE(kva_kv_trim(kv, &trimmed) == KVA_OK);
            ORACLE(trimmed == before.free_blocks + before.trimmed_blocks);
        }
        ORACLE(kva_kv_check(kv) == KVA_OK);
        kva_kv_stats st2;
        kva_kv_get_stats(kv, &st2);
        ORACLE(st2.free_blocks + st2.used_blocks + st2.cached_blocks + st2.trimmed_blocks == st2.num_blocks);
        ORACLE(st2.sequences + st2.pins == nlive);
    }
    for (size_t i = 0; i < nlive; i++)
        ORACLE((is_pin[i] ? kva_kv_unpin(kv, live[i]) : kva_kv_seq_free(kv, live[i])) == KVA_OK);
    ORACLE(kva_kv_evict(kv, UINT32_MAX, NULL) == KVA_OK);
    kva_kv_stats end;
    kva_kv_get_stats(kv, &end);
    ORACLE(end.free_blocks + end.trimmed_blocks == end.num_blocks);
    ORACLE(kva_kv_check(kv) == KVA_OK);
    kva_kv_destroy(kv);
    return 0;
}
