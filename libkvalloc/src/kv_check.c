/*
 * kv_check.c — kva_kv_check: walks every invariant stated in kv_cache.h and names the first one
 * broken. O(blocks + buckets + table entries + sequences); never on a hot path.
 */
#include <stdlib.h>

#include "kv_cache.h"

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

static kva_status check_states(const kva_kv *kv) {
    uint32_t counts[4] = {0, 0, 0, 0}, registered = 0;
    if (kv->backed_blocks > kv->num_blocks)
        return BROKEN("K1: %u blocks backed of %u", kv->backed_blocks, kv->num_blocks);
    for (uint32_t b = 0; b < kv->num_blocks; b++) {
        const kva_kv_block *blk = &kv->blocks[b];
        if (blk->state > KV_TRIMMED) return BROKEN("K1: block %u has state %u", b, blk->state);
        if ((blk->state == KV_TRIMMED) != (b >= kv->backed_blocks))
            return BROKEN("K1: block %u has state %u but %u blocks are backed", b, blk->state, kv->backed_blocks);
        if ((blk->state == KV_USED) != (blk->refs > 0))
            return BROKEN("K1: block %u has state %u and %u references", b, blk->state, blk->refs);
        if (blk->priority >= KVA_KV_PRIORITIES) return BROKEN("K4: block %u has priority %u", b, blk->priority);
        if (blk->state == KV_CACHED && !blk->registered) return BROKEN("K5: cached block %u is not registered", b);
        if (blk->state != KV_USED && blk->state != KV_CACHED && blk->registered)
            return BROKEN("K5: free block %u is registered", b);
        counts[blk->state]++;
        registered += blk->registered;
    }
    if (counts[KV_FREE] != kv->free_count || counts[KV_USED] != kv->used_count || counts[KV_CACHED] != kv->cached_count)
        return BROKEN("K1: %u free, %u used, %u cached blocks; the counters say %u, %u, %u", counts[KV_FREE],
                      counts[KV_USED], counts[KV_CACHED], kv->free_count, kv->used_count, kv->cached_count);
    if (registered != kv->registered_count)
        return BROKEN("K5: %u blocks are registered, the counter says %u", registered, kv->registered_count);
    if (kv->peak_used < kv->used_count || kv->peak_cached < kv->cached_count)
        return BROKEN("K1: peaks of %u used and %u cached blocks, below the %u and %u now", kv->peak_used,
                      kv->peak_cached, kv->used_count, kv->cached_count);
    return KVA_OK;
}

static kva_status check_free_stack(const kva_kv *kv, uint8_t *seen) {
    uint32_t count = 0, last = KVA_NIL;
    for (uint32_t b = kv->free_top; b != KVA_NIL; b = kv->blocks[b].next) {
        last = b;
        if (b >= kv->num_blocks) return BROKEN("K3: the free stack links to %u, past the end", b);
        if (kv->blocks[b].state != KV_FREE) return BROKEN("K3: block %u on the free stack is not free", b);
        if (seen[b]++) return BROKEN("K3: block %u is on the free stack twice", b);
        if (++count > kv->free_count) return BROKEN("K3: the free stack is longer than its count %u", kv->free_count);
    }
    if (count != kv->free_count)
        return BROKEN("K3: the free stack holds %u blocks, its count says %u", count, kv->free_count);
    if (last != kv->free_bottom)
        return BROKEN("K3: the free stack ends at %u, its bottom says %u", last, kv->free_bottom);
    return KVA_OK;
}

static kva_status check_prefix_table(const kva_kv *kv) {
    uint32_t chained = 0;
    for (uint32_t bucket = 0; bucket <= kv->bucket_mask; bucket++) {
        for (uint32_t b = kv->buckets[bucket]; b != KVA_NIL; b = kv->blocks[b].hash_next) {
            if (b >= kv->num_blocks) return BROKEN("K5: bucket %u links to %u, past the end", bucket, b);
            const kva_kv_block *blk = &kv->blocks[b];
            if (!blk->registered) return BROKEN("K5: block %u is chained but not registered", b);
            if ((blk->key.lo & kv->bucket_mask) != bucket)
                return BROKEN("K5: block %u is chained in the wrong bucket", b);
            if (++chained > kv->registered_count) return BROKEN("K5: the chains hold more blocks than are registered");
            if (blk->key_len > kv->max_key_bytes)
                return BROKEN("K5: block %u has an engine key of %u bytes; at most %u", b, blk->key_len,
                              kv->max_key_bytes);
            if (blk->key_len &&
                !kv_key_equal(blk->key, kv_key_engine(kv->root, blk->ns, kv_key_store(kv, b), blk->key_len)))
                return BROKEN("K5: block %u's engine key does not match its fingerprint", b);
            /* The rest of the chain, for a second block of the same key: bounded as the outer
             * walk is not yet past it (a link past the end, or a loop that never comes back to
             * b, is for the outer walk to report when it gets there). */
            uint32_t steps = 0;
            for (uint32_t o = blk->hash_next; o != KVA_NIL && o < kv->num_blocks && steps++ < kv->registered_count;
                 o = kv->blocks[o].hash_next) {
                if (o == b) return BROKEN("K5: the chain of bucket %u loops back to block %u", bucket, b);
                kv_ident id = kv_block_ident(kv, b);
                if (kv_block_holds(kv, o, &id)) return BROKEN("K5: blocks %u and %u share a key", b, o);
            }
        }
    }
    if (chained != kv->registered_count)
        return BROKEN("K5: %u blocks on the chains, %u registered", chained, kv->registered_count);
    return KVA_OK;
}

/* K9 for a live paged sequence: its chain state, and the key of its last full block. */
static kva_status check_chain(const kva_kv *kv, uint32_t s, const kva_kv_seqrec *rec) {
    if (rec->key_kind > KVA_KV_KEY_BYTES || (rec->key_kind != KVA_KV_KEY_NONE && rec->is_pin))
        return BROKEN("K9: sequence in slot %u has key kind %u (pin %u)", s, rec->key_kind, rec->is_pin);
    uint32_t full = rec->num_tokens / kv->block_tokens;
    kv_ident id = kv_ident_library(rec->chain, rec->ns);
    switch (rec->key_kind) {
    case KVA_KV_KEY_NONE: return KVA_OK;
    case KVA_KV_KEY_TOKENS:
        if (!rec->partial) return BROKEN("K9: sequence in slot %u is keyed by token ids but has no partial buffer", s);
        break;
    case KVA_KV_KEY_BYTES:
        if (rec->key_len == 0 || rec->key_len > kv->max_key_bytes || rec->has_last != (full > 0))
            return BROKEN("K9: sequence in slot %u has engine keys of %u bytes, has_last %u at %u full blocks", s,
                          rec->key_len, rec->has_last, full);
        id = kv_ident_engine(kv, rec->ns, rec->last_key, rec->key_len);
        break;
    }
    if (full == 0) return KVA_OK;
    uint32_t b = rec->table[full - 1];
    if (kv->blocks[b].registered && !kv_block_holds(kv, b, &id))
        return BROKEN("K9: sequence in slot %u's last full block %u is registered under a key other than its chain's",
                      s, b);
    return KVA_OK;
}

/* K2, K6, K7 and K9: counts each block's references from the tables. */
static kva_status check_sequences(const kva_kv *kv, uint32_t *refs) {
    uint32_t live = 0, pins = 0, free_slots = 0;
    for (uint32_t s = 0; s < kv->seq_slots; s++) {
        const kva_kv_seqrec *rec = &kv->seqs[s];
        if (rec->generation == 0) return BROKEN("K7: slot %u has generation 0", s);
        if (!rec->live) continue;
        if (rec->is_pin) pins++;
        else live++;
        if (kv->info.mode != KVA_KV_PAGED) {
            if (rec->key_kind != KVA_KV_KEY_NONE) return BROKEN("K9: contiguous sequence in slot %u is keyed", s);
            continue;
        }
        uint64_t blocks = ((uint64_t)rec->num_tokens + kv->block_tokens - 1) / kv->block_tokens;
        if (rec->len != blocks || rec->len > rec->cap)
            return BROKEN("K7: sequence in slot %u has %u tokens but %u blocks (room for %u)", s, rec->num_tokens,
                          rec->len, rec->cap);
        for (uint32_t i = 0; i < rec->len; i++) {
            uint32_t b = rec->table[i];
            if (b >= kv->num_blocks) return BROKEN("K2: sequence in slot %u names block %u, past the end", s, b);
            refs[b]++;
            if (kv->blocks[b].registered && (uint64_t)(i + 1) * kv->block_tokens > rec->num_tokens)
                return BROKEN("K6: registered block %u is the partial block %u of the sequence in slot %u", b, i, s);
        }
        kva_status st = check_chain(kv, s, rec);
        if (st != KVA_OK) return st;
    }
    for (uint32_t s = kv->free_slot; s != KVA_NIL; s = kv->seqs[s].next_free) {
        if (s >= kv->seq_slots || kv->seqs[s].live)
            return BROKEN("K7: free-slot list names slot %u, not a free slot", s);
        if (++free_slots > kv->seq_slots) return BROKEN("K7: the free-slot list loops");
    }
    if (live != kv->live_seqs || pins != kv->live_pins || live + pins + free_slots != kv->seq_slots)
        return BROKEN("K7: %u live sequences, %u pins and %u free slots of %u; the counters say %u and %u", live, pins,
                      free_slots, kv->seq_slots, kv->live_seqs, kv->live_pins);
    return KVA_OK;
}

/* K10: the event ring. */
static kva_status check_events(const kva_kv *kv) {
    if (!kv->events) return kv->event_count == 0 ? KVA_OK : BROKEN("K10: %u events without a ring", kv->event_count);
    if (kv->event_count > kv->event_capacity || kv->event_head >= kv->event_capacity)
        return BROKEN("K10: %u events from %u in a ring of %u", kv->event_count, kv->event_head, kv->event_capacity);
    for (uint32_t i = 0; i < kv->event_count; i++) {
        const kva_kv_event *ev = &kv->events[(kv->event_head + i) % kv->event_capacity];
        if (ev->kind < KVA_KV_EVENT_STORED || ev->kind > KVA_KV_EVENT_CLEARED || ev->key_len > KVA_KV_MAX_KEY_BYTES ||
            ev->parent_len > KVA_KV_MAX_KEY_BYTES)
            return BROKEN("K10: event %u has kind %u, key_len %u, parent_len %u", i, ev->kind, ev->key_len,
                          ev->parent_len);
    }
    return KVA_OK;
}

static kva_status check_paged(kva_kv *kv) {
    if (kva_usable_size(kv->pool, kv->memory) < kv->info.kv_bytes)
        return BROKEN("K0: the KV memory at %p is not a live allocation of %zu bytes", (void *)kv->memory,
                      kv->info.kv_bytes);
    kva_status st = check_states(kv);
    if (st != KVA_OK) return st;
    uint8_t *seen = calloc(kv->num_blocks, 1);
    uint32_t *refs = calloc(kv->num_blocks, sizeof *refs);
    if (!seen || !refs) {
        free(seen);
        free(refs);
        return kva_fail(KVA_ERR_NOMEM, "no host memory to check %u blocks", kv->num_blocks);
    }
    st = check_free_stack(kv, seen);
    if (st == KVA_OK) st = kv_lru_check(kv, seen);
    if (st == KVA_OK) st = check_prefix_table(kv);
    if (st == KVA_OK) st = check_sequences(kv, refs);
    uint64_t loose = 0;
    for (uint32_t b = 0; st == KVA_OK && b < kv->num_blocks; b++) {
        if (kv->loose[b] & KV_LOOSE_MARK) st = BROKEN("K2: block %u's loose count %#x carries a mark", b, kv->loose[b]);
        else if (refs[b] + (uint64_t)kv->loose[b] != kv->blocks[b].refs)
            st = BROKEN("K2: block %u has %u references but %u table entries name it and the engine holds %u", b,
                        kv->blocks[b].refs, refs[b], kv->loose[b]);
        loose += kv->loose[b];
    }
    if (st == KVA_OK && loose != kv->loose_refs)
        st = BROKEN("K2: the engine holds %llu references; the counter says %llu", (unsigned long long)loose,
                    (unsigned long long)kv->loose_refs);
    if (st == KVA_OK) st = check_events(kv);
    if (st == KVA_OK) st = kv_pins_check(kv);
    if (st == KVA_OK) st = kv_ns_check(kv);
    free(seen);
    free(refs);
    return st;
}

static int compare_addresses(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
    return (x > y) - (x < y);
}

/* K8's "each buffer belongs to one sequence": two sequences naming one buffer would free it
 * twice and leak another, and their sizes can still add up to the counter. */
static kva_status check_buffers_distinct(const kva_kv *kv) {
    void **buffers = malloc(2 * (size_t)kv->seq_slots * sizeof *buffers + 1);
    if (!buffers) return kva_fail(KVA_ERR_NOMEM, "no host memory to check %u sequences", kv->seq_slots);
    size_t n = 0;
    for (uint32_t s = 0; s < kv->seq_slots; s++) {
        if (!kv->seqs[s].live) continue;
        buffers[n++] = kv->seqs[s].buffer;
        if (kv->seqs[s].retired) buffers[n++] = kv->seqs[s].retired;
    }
    qsort(buffers, n, sizeof *buffers, compare_addresses);
    kva_status st = KVA_OK;
    for (size_t i = 1; st == KVA_OK && i < n; i++)
        if (buffers[i] == buffers[i - 1]) st = BROKEN("K8: buffer %p belongs to two sequences", buffers[i]);
    free(buffers);
    return st;
}

static kva_status check_contiguous(kva_kv *kv) {
    kva_status st = check_sequences(kv, NULL); /* no tables in contiguous mode */
    if (st == KVA_OK) st = check_buffers_distinct(kv);
    if (st == KVA_OK) st = kv_ns_check(kv);
    if (st != KVA_OK) return st;
    size_t bytes = 0;
    for (uint32_t s = 0; s < kv->seq_slots; s++) {
        const kva_kv_seqrec *rec = &kv->seqs[s];
        if (!rec->live) continue;
        uint32_t bucket = rec->bucket_tokens;
        if (!kva_is_pow2(bucket) || bucket < KVA_KV_MIN_BUCKET || bucket > kv->max_context || rec->num_tokens > bucket)
            return BROKEN("K8: sequence in slot %u has %u tokens in a bucket of %u", s, rec->num_tokens, bucket);
        size_t usable = kva_usable_size(kv->pool, rec->buffer);
        if (usable < (size_t)bucket * kv->info.token_bytes)
            return BROKEN("K8: sequence in slot %u holds %zu pool bytes for a bucket of %zu", s, usable,
                          (size_t)bucket * kv->info.token_bytes);
        bytes += usable;
        if (rec->retired) {
            size_t old = kva_usable_size(kv->pool, rec->retired);
            if (old == 0) return BROKEN("K8: sequence in slot %u keeps a retired buffer that is not allocated", s);
            bytes += old;
        }
    }
    if (bytes != kv->contig_bytes)
        return BROKEN("K8: sequences hold %zu pool bytes, the counter says %zu", bytes, kv->contig_bytes);
    return KVA_OK;
}

static kva_status check_locked(kva_kv *kv) {
    kva_status st = kv->info.mode == KVA_KV_PAGED ? check_paged(kv) : check_contiguous(kv);
    /* Lock order: the cache's lock, then the pool's (kva_check takes them). */
    if (st == KVA_OK && kv->owns_pool) st = kva_check(kv->pool);
    return st;
}

kva_status kva_kv_check(kva_kv *kv) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv, KVA_KV_CALL_OTHER);
    kva_status st = check_locked(kv);
    kv_unlock(kv);
    return st;
}
