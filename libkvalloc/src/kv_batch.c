/*
 * kv_batch.c — the per-step batch calls over sequences: admit many, extend many (one decode
 * step), free many. Each takes the cache's lock once, checks every request, then does what the
 * single call does for each in order (kv_seq.c), so a batch costs one lock and one call's
 * overhead however many requests it holds.
 *
 * A request's content is its slice of the batch's flattened content (kv_content_slice). A handle
 * listed twice is found by the slot's `listed`, set to the call's number as the list is checked:
 * a slot that already holds it was listed before in the same call. Nothing needs clearing after,
 * refused call or not, since the next call has another number. A batch that runs out of blocks stops at the request
 * that does not fit: the requests before it are done exactly as single calls would have done
 * them, the ones from it on are untouched (kv_admit and kv_extend change nothing when they
 * fail), and the call says how many were done.
 */
#include <stdio.h>

#include "kv_cache.h"

#define INVALID(...) kv_reject(kv, kva_fail(KVA_ERR_INVALID, __VA_ARGS__))

/* The batch's content, checked, and its total of items (0 without content). */
static kva_status batch_content(kva_kv *kv, uint32_t count, const kva_kv_content *content, const uint64_t *offsets,
                                kv_content *all) {
    uint64_t total = 0;
    if (content) {
        kva_status st = kv_offsets_check(kv, offsets, count, &total);
        if (st != KVA_OK) return st;
    }
    return kv_content_check(kv, content, total, 0, all);
}

/* Request i's part of the batch's content, in namespace ns. */
static kv_content request_content(const kva_kv *kv, const kv_content *all, const uint64_t *offsets, uint32_t i,
                                  uint64_t ns) {
    kv_content c = *all;
    c.ns = ns;
    if (c.kind != KVA_KV_KEY_NONE) kv_content_slice(kv, &c, offsets[i], (uint32_t)(offsets[i + 1] - offsets[i]));
    return c;
}

/* A number for this batch call's listings, never 0 (what a fresh slot holds) and, after the
 * count wraps, never one a slot holds from before. */
static uint32_t new_batch(kva_kv *kv) {
    if (++kv->batch == 0) {
        for (uint32_t s = 0; s < kv->seq_capacity; s++) kv->seqs[s].listed = 0;
        kv->batch = 1;
    }
    return kv->batch;
}

/* ---- admit --------------------------------------------------------------------------------- */

/* A request's refusal, its reason named with its index (the caller's arrays may hold thousands). */
static kva_status refused_request(kva_status st, uint32_t i) {
    char why[256];
    snprintf(why, sizeof why, "%s", kva_last_error());
    return kva_fail(st, "request %u: %s", i, why);
}

static kva_status admit_many_locked(kva_kv *kv, uint32_t count, const uint32_t *num_tokens, const uint64_t *namespaces,
                                    const uint8_t *priorities, const kva_kv_content *content, const uint64_t *offsets,
                                    kva_kv_seq *seqs, uint32_t *cached_tokens, uint32_t *done) {
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("batches need paged mode; this cache is contiguous");
    if (!done || (count && (!num_tokens || !seqs))) return INVALID("done, num_tokens or seqs is NULL");
    kv_content all;
    kva_status st = batch_content(kv, count, content, offsets, &all);
    if (st != KVA_OK) return st;
    for (uint32_t i = 0; i < count; i++) {
        kv_content c = request_content(kv, &all, offsets, i, namespaces ? namespaces[i] : 0);
        st = kv_admit_check(kv, num_tokens[i], priorities ? priorities[i] : 0, &c);
        if (st != KVA_OK) return refused_request(st, i); /* counted as rejected once, there */
    }
    uint32_t i = 0;
    for (; i < count; i++) {
        kv_content c = request_content(kv, &all, offsets, i, namespaces ? namespaces[i] : 0);
        if (kv_admit(kv, num_tokens[i], &c, priorities ? priorities[i] : 0, &seqs[i],
                     cached_tokens ? &cached_tokens[i] : NULL) != KVA_OK)
            break; /* it does not fit: kva_last_error says why */
    }
    *done = i;
    return KVA_OK;
}

kva_status kva_kv_seq_admit_many(kva_kv *kv, uint32_t count, const uint32_t *num_tokens, const uint64_t *namespaces,
                                 const uint8_t *priorities, const kva_kv_content *content, const uint64_t *offsets,
                                 kva_kv_seq *seqs, uint32_t *cached_tokens, uint32_t *done) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_ALLOCATE);
    if (st == KVA_OK)
        st = admit_many_locked(kv, count, num_tokens, namespaces, priorities, content, offsets, seqs, cached_tokens,
                               done);
    kv_unlock(kv);
    return st;
}

/* ---- extend -------------------------------------------------------------------------------- */

/* Every listed sequence is live, listed once, and may be extended as asked. */
static kva_status extend_many_check(kva_kv *kv, uint32_t count, const kva_kv_seq *seqs, const uint32_t *num_tokens,
                                    const kv_content *all, const uint64_t *offsets) {
    kva_status st;
    uint32_t batch = new_batch(kv);
    for (uint32_t i = 0; i < count; i++) {
        kva_kv_seqrec *rec = kv_live_seq(kv, seqs[i], &st);
        if (!rec) return st;
        if (rec->listed == batch)
            return INVALID("sequence %#llx is listed twice (entry %u)", (unsigned long long)seqs[i], i);
        rec->listed = batch;
        if (rec->len) __builtin_prefetch(&rec->table[rec->len - 1]); /* for the pass after the checks */
        kv_content c = request_content(kv, all, offsets, i, rec->ns);
        st = kv_extend_check(kv, rec, seqs[i], num_tokens[i], &c);
        if (st != KVA_OK) return st;
    }
    return KVA_OK;
}

static kva_status extend_many_locked(kva_kv *kv, uint32_t count, const kva_kv_seq *seqs, const uint32_t *num_tokens,
                                     const kva_kv_content *content, const uint64_t *offsets, kva_kv_block_copy *copies,
                                     uint32_t *num_copies, uint32_t *done) {
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("batches need paged mode; this cache is contiguous");
    if (!done || !num_copies || (count && (!seqs || !num_tokens || !copies)))
        return INVALID("done, num_copies, seqs, num_tokens or copies is NULL");
    kv_content all;
    kva_status st = batch_content(kv, count, content, offsets, &all);
    if (st == KVA_OK) st = extend_many_check(kv, count, seqs, num_tokens, &all, offsets);
    if (st != KVA_OK) return st;
    /* The checks loaded every listed record and started loading its last table entry; this pass
     * starts loading the blocks those entries name (an extension reads its last block's refs),
     * so that the extensions wait on memory about once for the batch instead of three times a
     * sequence: between steps the engine's own work evicts them from the cache. */
    for (uint32_t i = 0; i < count; i++) {
        const kva_kv_seqrec *rec = kv_seq_lookup(kv, seqs[i], &st);
        if (rec->len) __builtin_prefetch(&kv->blocks[rec->table[rec->len - 1]]);
    }
    uint32_t i = 0, copied = 0;
    for (; i < count; i++) {
        kva_kv_seqrec *rec = kv_seq_lookup(kv, seqs[i], &st);
        kv_content c = request_content(kv, &all, offsets, i, rec->ns);
        kva_kv_copy copy;
        if (kv_extend(kv, rec, num_tokens[i], &c, &copy) != KVA_OK) break; /* kva_last_error says why */
        kv->counters.appends++;
        if (copy.tokens) copies[copied++] = (kva_kv_block_copy){i, copy.src_block, copy.dst_block, copy.tokens};
    }
    *num_copies = copied;
    *done = i;
    return KVA_OK;
}

kva_status kva_kv_seq_extend_many(kva_kv *kv, uint32_t count, const kva_kv_seq *seqs, const uint32_t *num_tokens,
                                  const kva_kv_content *content, const uint64_t *offsets, kva_kv_block_copy *copies,
                                  uint32_t *num_copies, uint32_t *done) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_APPEND);
    if (st == KVA_OK) st = extend_many_locked(kv, count, seqs, num_tokens, content, offsets, copies, num_copies, done);
    kv_unlock(kv);
    return st;
}

kva_status kva_kv_seq_extend_step(kva_kv *kv, kva_kv_step *step, uint32_t count) {
    if (!step) return kva_fail(KVA_ERR_INVALID, "step is NULL");
    return kva_kv_seq_extend_many(kv, count, step->seqs, step->num_tokens, step->content, step->offsets, step->copies,
                                  &step->num_copies, &step->done);
}

/* ---- free ---------------------------------------------------------------------------------- */

static kva_status free_many_locked(kva_kv *kv, uint32_t count, const kva_kv_seq *seqs) {
    if (count && !seqs) return INVALID("seqs is NULL but count is %u", count);
    kva_status st;
    uint32_t batch = new_batch(kv);
    for (uint32_t i = 0; i < count; i++) {
        kva_kv_seqrec *rec = kv_seq_lookup(kv, seqs[i], &st);
        if (!rec) return kv_reject(kv, st);
        if (rec->is_pin) return INVALID("%#llx is a pin; use kva_kv_unpin", (unsigned long long)seqs[i]);
        if (rec->listed == batch)
            return kv_reject(kv, kva_fail(KVA_ERR_DOUBLE_FREE, "sequence %#llx is listed twice (entry %u)",
                                          (unsigned long long)seqs[i], i));
        rec->listed = batch;
    }
    for (uint32_t i = 0; i < count; i++) kv_seq_release(kv, kv_seq_lookup(kv, seqs[i], &st));
    return KVA_OK;
}

kva_status kva_kv_seq_free_many(kva_kv *kv, uint32_t count, const kva_kv_seq *seqs) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_FREE);
    if (st == KVA_OK) st = free_many_locked(kv, count, seqs);
    kv_unlock(kv);
    return st;
}
