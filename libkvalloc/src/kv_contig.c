/*
 * kv_contig.c — contiguous mode: each sequence owns one buffer from the pool holding a
 * power-of-two bucket of tokens (KVA_KV_MIN_BUCKET .. max_context), laid out
 * [layer][K|V][token][kv_head][head_dim] so each (layer, part) slice is contiguous for kernels
 * that want one KV run per request. Growing past the bucket moves the sequence to the smallest
 * bucket that holds it; the old buffer is kept until the sequence's next append or free so the
 * engine can copy from it in between.
 *
 * Buffers are kva_alloc_exact allocations: a bucket whose byte size is not a power of two (a
 * model with 28 layers) is rounded only to the pool's min_block, not doubled.
 */
#include "kv_cache.h"

#define INVALID(...) kv_reject(kv, kva_fail(KVA_ERR_INVALID, __VA_ARGS__))

static uint32_t bucket_for(uint32_t tokens) {
    if (tokens <= KVA_KV_MIN_BUCKET) return KVA_KV_MIN_BUCKET;
    return (uint32_t)1 << (kva_log2(tokens - 1) + 1);
}

/* A buffer for `bucket` tokens; the pool's status on failure (counted as a failed allocation). */
static kva_status buffer_alloc(kva_kv *kv, uint32_t bucket, unsigned char **out) {
    void *buffer;
    kva_status st = kva_alloc_exact(kv->pool, (size_t)bucket * kv->info.token_bytes, &buffer);
    if (st != KVA_OK) {
        kv->counters.alloc_failures++;
        return st;
    }
    kv->contig_bytes += kva_usable_size(kv->pool, buffer);
    if (kv->contig_bytes > kv->peak_contig_bytes) kv->peak_contig_bytes = kv->contig_bytes;
    *out = buffer;
    return KVA_OK;
}

static void buffer_free(kva_kv *kv, unsigned char *buffer) {
    if (!buffer) return;
    kv->contig_bytes -= kva_usable_size(kv->pool, buffer);
    kva_free(kv->pool, buffer);
}

kva_status kv_contig_allocate(kva_kv *kv, uint32_t num_tokens, uint32_t priority, kva_kv_seq *seq) {
    if (num_tokens > kv->max_context) return INVALID("%u tokens exceed max_context %u", num_tokens, kv->max_context);
    uint32_t bucket = bucket_for(num_tokens);
    kva_kv_seqrec *rec = kv_seq_reserve(kv, 0);
    if (!rec) {
        kv->counters.alloc_failures++;
        return KVA_ERR_NOMEM;
    }
    unsigned char *buffer;
    kva_status st = buffer_alloc(kv, bucket, &buffer);
    if (st != KVA_OK) return st;
    rec->buffer = buffer;
    rec->retired = NULL;
    rec->bucket_tokens = bucket;
    rec->len = 0;
    rec->num_tokens = num_tokens;
    rec->cached_tokens = 0;
    rec->ns = 0;
    rec->priority = (uint8_t)priority;
    rec->is_pin = 0;
    *seq = kv_seq_publish(kv, rec);
    kv->counters.allocations++;
    kv->counters.query_tokens += num_tokens;
    return KVA_OK;
}

kva_status kv_contig_append(kva_kv *kv, kva_kv_seqrec *rec, uint32_t num_tokens, kva_kv_copy *copy) {
    uint32_t new_tokens = rec->num_tokens + num_tokens;
    if (new_tokens > kv->max_context) return INVALID("%u tokens exceed max_context %u", new_tokens, kv->max_context);
    kva_kv_copy out = {KVA_KV_NO_BLOCK, KVA_KV_NO_BLOCK, 0, 0, 0, NULL, NULL};
    if (new_tokens > rec->bucket_tokens) {
        uint32_t bucket = bucket_for(new_tokens);
        unsigned char *buffer;
        kva_status st = buffer_alloc(kv, bucket, &buffer);
        if (st != KVA_OK) return st;
        out = (kva_kv_copy){KVA_KV_NO_BLOCK, KVA_KV_NO_BLOCK, rec->num_tokens, rec->bucket_tokens,
                            bucket,          rec->buffer,     buffer};
        buffer_free(kv, rec->retired);
        rec->retired = rec->buffer;
        rec->buffer = buffer;
        rec->bucket_tokens = bucket;
        kv->counters.moves++;
        kv->counters.moved_bytes += (uint64_t)rec->num_tokens * kv->info.token_bytes;
    } else {
        buffer_free(kv, rec->retired);
        rec->retired = NULL;
    }
    rec->num_tokens = new_tokens;
    *copy = out;
    return KVA_OK;
}

void kv_contig_release(kva_kv *kv, kva_kv_seqrec *rec) {
    buffer_free(kv, rec->retired);
    buffer_free(kv, rec->buffer);
}
