/*
 * fuzz_kv_contig.c — the KV cache's contiguous mode, which fuzz_kv (paged) never enters: one to
 * three layers, capacities from 256 KiB to 2 MiB and the maximum contexts the input gives; then
 * sequences allocated, grown (often past their bucket, so that they move), freed, and used again
 * after their free, with compaction, trim and fork, which the mode refuses.
 *
 * After every step: each live sequence's bucket is a power of two of at least 64 tokens that
 * holds it; live buffers never overlap; a move's copy descriptor names the old and the new buffer
 * and bucket and the tokens to copy; what the engine wrote survives the copy it makes; a freed
 * handle is refused; kva_kv_check passes and the sequence count is the model's.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "fuzz_input.h"
#include "kvalloc.h"

#define MAX_SEQS 32

typedef struct model_seq {
    kva_kv_seq handle;
    uint32_t tokens;
    unsigned char stamp; /* the first byte of every token's slot in layer 0's K */
} model_seq;

/* Bytes of a buffer of `bucket` tokens: K and V of every layer. */
static size_t buffer_bytes(const kva_kv_info *info, uint32_t bucket) {
    return (size_t)2 * info->layers * bucket * info->slot_bytes;
}

static kva_kv_seq_info seq_info(kva_kv *kv, kva_kv_seq handle) {
    kva_kv_seq_info si;
    ORACLE(kva_kv_seq_get_info(kv, handle, &si) == KVA_OK);
    return si;
}

static void stamp_tokens(const kva_kv_info *info, void *buffer, uint32_t from, uint32_t count, unsigned char stamp) {
    memset((unsigned char *)buffer + (size_t)from * info->slot_bytes, stamp, (size_t)count * info->slot_bytes);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    input in = {data, size, 0};
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.mode = KVA_KV_CONTIGUOUS;
    cfg.layers = 1 + next_byte(&in) % 3;
    cfg.kv_heads = 1;
    cfg.head_dim = 8;
    cfg.dtype_bytes = 2;
    cfg.capacity_bytes = ((size_t)256 << 10) << (next_byte(&in) % 4);
    unsigned context = next_byte(&in) % 6;
    cfg.max_context = context ? (uint32_t)64 << context : 0;
    cfg.pages = KVA_PAGES_SMALL;
    kva_kv *kv;
    kva_status created = kva_kv_create(&cfg, NULL, &kv);
    if (created != KVA_OK) {
        ORACLE(created == KVA_ERR_INVALID || created == KVA_ERR_NOMEM);
        return 0;
    }
    kva_kv_info info;
    ORACLE(kva_kv_get_info(kv, &info) == KVA_OK);
    ORACLE(info.mode == KVA_KV_CONTIGUOUS && info.max_context >= 64 &&
           (info.max_context & (info.max_context - 1)) == 0);
    model_seq live[MAX_SEQS];
    kva_kv_seq freed[MAX_SEQS];
    size_t nlive = 0, nfreed = 0;
    unsigned char stamp = 1;

    while (in.at < in.size) {
        unsigned op = next_byte(&in) % 6;
        if (op <= 1 && nlive < MAX_SEQS) {
            uint32_t tokens = op == 0 ? next_u16(&in) % 300 : next_u16(&in) * 7u;
            kva_kv_seq handle;
            uint32_t cached = 77;
            kva_status st = kva_kv_seq_allocate(kv, tokens, NULL, 0, NULL, 0, 0, next_byte(&in) % 9, &handle, &cached);
            if (st == KVA_OK) {
                kva_kv_seq_info si = seq_info(kv, handle);
                ORACLE(si.num_tokens == tokens && si.bucket_tokens >= tokens && si.bucket_tokens >= 64);
                ORACLE(si.bucket_tokens <= info.max_context && (si.bucket_tokens & (si.bucket_tokens - 1)) == 0);
                ORACLE(si.buffer != NULL && cached == 0); /* no prefix caching in this mode */
                live[nlive] = (model_seq){handle, tokens, stamp};
                stamp = stamp == 255 ? 1 : stamp + 1;
                stamp_tokens(&info, si.buffer, 0, tokens, live[nlive].stamp);
                nlive++;
            } else {
                ORACLE(st == KVA_ERR_NOMEM || st == KVA_ERR_INVALID);
            }
        } else if (op == 2 && nlive > 0) {
            model_seq *m = &live[next_byte(&in) % nlive];
            kva_kv_seq_info before = seq_info(kv, m->handle);
            uint32_t more = next_byte(&in) % 3 == 0 ? next_u16(&in) : next_byte(&in) % 70;
            kva_kv_copy copy;
            kva_status st = kva_kv_seq_append(kv, m->handle, more, &copy);
            kva_kv_seq_info after = seq_info(kv, m->handle);
            if (st == KVA_OK) {
                ORACLE(after.num_tokens == m->tokens + more && after.bucket_tokens >= after.num_tokens);
                if (after.buffer != before.buffer) {
                    /* Moved: the descriptor says what the engine copies; it copies layer 0's K. */
                    ORACLE(copy.src == before.buffer && copy.dst == after.buffer && copy.tokens == m->tokens);
                    ORACLE(copy.src_bucket == before.bucket_tokens && copy.dst_bucket == after.bucket_tokens);
                    memcpy(copy.dst, copy.src, (size_t)copy.tokens * info.slot_bytes);
                } else {
                    ORACLE(copy.tokens == 0 && copy.src == NULL);
                }
                stamp_tokens(&info, after.buffer, m->tokens, more, m->stamp);
                m->tokens += more;
            } else {
                ORACLE(st == KVA_ERR_NOMEM || st == KVA_ERR_INVALID);
                ORACLE(after.buffer == before.buffer && after.num_tokens == before.num_tokens); /* nothing changed */
            }
        } else if (op == 3 && nlive > 0) {
            size_t i = next_byte(&in) % nlive;
            kva_kv_seq_info si = seq_info(kv, live[i].handle);
            for (uint32_t t = 0; t < live[i].tokens; t++)
                ORACLE(((unsigned char *)si.buffer)[(size_t)t * info.slot_bytes] == live[i].stamp);
            ORACLE(kva_kv_seq_free(kv, live[i].handle) == KVA_OK);
            if (nfreed < MAX_SEQS) freed[nfreed++] = live[i].handle;
            live[i] = live[--nlive];
        } else if (op == 4 && nfreed > 0) {
            kva_kv_seq handle = freed[next_byte(&in) % nfreed];
            kva_kv_copy copy;
            kva_kv_seq_info si;
            ORACLE(kva_kv_seq_free(kv, handle) != KVA_OK);
            ORACLE(kva_kv_seq_append(kv, handle, 1, &copy) != KVA_OK);
            ORACLE(kva_kv_seq_get_info(kv, handle, &si) != KVA_OK);
        } else if (op == 5) {
            kva_kv_move moves[4];
            uint32_t n, trimmed;
            kva_kv_seq child = 0;
            ORACLE(kva_kv_compact(kv, moves, 4, &n) == KVA_ERR_INVALID);
            ORACLE(kva_kv_trim(kv, &trimmed) == KVA_ERR_INVALID);
            ORACLE(kva_kv_seq_fork(kv, nlive ? live[0].handle : 1, &child) != KVA_OK);
        }
        for (size_t a = 0; a < nlive; a++) {
            kva_kv_seq_info x = seq_info(kv, live[a].handle);
            for (size_t b = a + 1; b < nlive; b++) {
                kva_kv_seq_info y = seq_info(kv, live[b].handle);
                unsigned char *xp = x.buffer, *yp = y.buffer;
                ORACLE(xp + buffer_bytes(&info, x.bucket_tokens) <= yp ||
                       yp + buffer_bytes(&info, y.bucket_tokens) <= xp);
            }
        }
        kva_status checked = kva_kv_check(kv);
        if (checked != KVA_OK) fprintf(stderr, "kva_kv_check: %s\n", kva_last_error());
        ORACLE(checked == KVA_OK);
        kva_kv_stats st;
        kva_kv_get_stats(kv, &st);
        ORACLE(st.sequences == nlive);
    }
    for (size_t i = 0; i < nlive; i++) ORACLE(kva_kv_seq_free(kv, live[i].handle) == KVA_OK);
    ORACLE(kva_kv_check(kv) == KVA_OK);
    kva_kv_destroy(kv);
    return 0;
}
