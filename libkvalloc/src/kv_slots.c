/*
 * kv_slots.c — sequence handles: slots reused through a free-slot list, each with a generation
 * that changes when its sequence is freed, so a stale handle is told apart from a live one.
 *
 * A handle is generation << 32 | (slot ^ key). Generations start at 1 (so 0 is never a handle)
 * and step by one per free, skipping 0 when they wrap. A freed slot keeps its table allocation
 * for the next sequence, so a steady engine stops calling malloc.
 *
 * The key is the cache's own, so that a handle given to another cache is refused: decoded with
 * the wrong key its slot is the true slot XOR the two keys, never the same slot since keys
 * differ. The keys are a process-wide count of caches times 2^32 / phi (Knuth's multiplicative
 * hashing, TAOCP vol. 3, 6.4), which spreads any number of caches' keys about evenly over the 32
 * bits: any two of the first 4,096 caches' keys differ (XOR) by at least 744,616, so a cache with
 * fewer slots than that (one that never had as many sequences and pins live at once) refuses all
 * of their handles (test_kv_bad_input checks the bound). Beyond, a slot that lands in range must
 * still have a live sequence of the handle's generation.
 */
#include <stdlib.h>
#include <string.h>

#include "kv_cache.h"

kva_status kv_reject(kva_kv *kv, kva_status status) {
    kv->counters.rejected_calls++;
    return status;
}

uint32_t kv_new_handle_key(void) {
    static uint32_t caches;
    return kv_handle_key(__atomic_add_fetch(&caches, 1, __ATOMIC_RELAXED));
}

kva_kv_seqrec *kv_seq_refused(const kva_kv *kv, kva_kv_seq seq, kva_status *why) {
    uint32_t slot = (uint32_t)seq ^ kv->handle_key, generation = (uint32_t)(seq >> 32);
    if (slot >= kv->seq_slots || generation == 0) {
        *why = kva_fail(KVA_ERR_INVALID, "sequence handle %#llx was never given by this cache",
                        (unsigned long long)seq);
        return NULL;
    }
    const kva_kv_seqrec *rec = &kv->seqs[slot];
    /* Generations only grow (modulo 2^32), so an older one is a freed sequence. */
    if ((int32_t)(rec->generation - generation) > 0) {
        *why = kva_fail(KVA_ERR_DOUBLE_FREE, "sequence %#llx was already freed", (unsigned long long)seq);
        return NULL;
    }
    *why = kva_fail(KVA_ERR_INVALID, "sequence handle %#llx was never given by this cache", (unsigned long long)seq);
    return NULL;
}

int kv_table_reserve(kva_kv_seqrec *rec, uint32_t blocks) {
    if (blocks <= rec->cap) return 1;
    uint32_t cap = rec->cap ? rec->cap : 8;
    while (cap < blocks) cap = cap > UINT32_MAX / 2 ? blocks : cap * 2;
    uint32_t *table = realloc(rec->table, (size_t)cap * sizeof *table);
    if (!table) return 0;
    rec->table = table;
    rec->cap = cap;
    return 1;
}

kva_kv_seqrec *kv_seq_reserve(kva_kv *kv, uint32_t blocks) {
    kva_kv_seqrec *rec;
    if (kv->free_slot != KVA_NIL) {
        rec = &kv->seqs[kv->free_slot];
    } else {
        if (kv->seq_slots == kv->seq_capacity) {
            if (kv->seq_capacity >= KVA_NIL / 2) {
                kva_fail(KVA_ERR_NOMEM, "too many sequences (%u)", kv->seq_slots);
                return NULL;
            }
            uint32_t capacity = kv->seq_capacity ? kv->seq_capacity * 2 : 64;
            kva_kv_seqrec *seqs = realloc(kv->seqs, (size_t)capacity * sizeof *seqs);
            if (!seqs) {
                kva_fail(KVA_ERR_NOMEM, "no host memory for %u sequence slots", capacity);
                return NULL;
            }
            memset(seqs + kv->seq_capacity, 0, (size_t)(capacity - kv->seq_capacity) * sizeof *seqs);
            kv->seqs = seqs;
            kv->seq_capacity = capacity;
        }
        /* A fresh slot not yet counted in seq_slots: publishing counts it. */
        rec = &kv->seqs[kv->seq_slots];
        if (rec->generation == 0) rec->generation = 1;
    }
    if (!kv_table_reserve(rec, blocks ? blocks : 1)) { /* a table pointer is never NULL */
        kva_fail(KVA_ERR_NOMEM, "no host memory for a table of %u blocks", blocks);
        return NULL;
    }
    return rec;
}

/* Counts a sequence made live in row `row` of the namespace table (K12); the row is kept in the
 * record for its growth and its free. */
static inline void ns_count(kva_kv *kv, kva_kv_seqrec *rec, uint32_t row) {
    rec->ns_slot = (uint8_t)row;
    kv_ns_row *r = &kv->ns.rows[row];
    r->live[rec->is_pin]++;
    r->blocks += rec->len;
}

/* kv_seq_publish's namespace other than the last one looked up: the search, out of line. */
static __attribute__((noinline)) kva_kv_seq publish_searched(kva_kv *kv, kva_kv_seqrec *rec, kva_kv_seq handle) {
    ns_count(kv, rec, kv_ns_lookup(kv, rec->ns));
    return handle;
}

kva_kv_seq kv_seq_publish(kva_kv *kv, kva_kv_seqrec *rec) {
    uint32_t slot = (uint32_t)(rec - kv->seqs);
    if (slot == kv->free_slot) kv->free_slot = rec->next_free;
    else kv->seq_slots++;
    rec->live = 1;
    rec->next_free = KVA_NIL;
    if (rec->is_pin) kv->live_pins++;
    else kv->live_seqs++;
    kva_kv_seq handle = kv_handle(kv, slot, rec->generation);
    /* The memo's namespace (a compare) counts here; any other in a tail call, so that this
     * path sets up no frame. */
    if (kva_unlikely(kv->ns.memo_ns != rec->ns)) return publish_searched(kv, rec, handle);
    ns_count(kv, rec, kv->ns.memo);
    return handle;
}

void kv_seq_retire(kva_kv *kv, kva_kv_seqrec *rec) {
    if (rec->is_pin) kv->live_pins--;
    else kv->live_seqs--;
    kv_ns_row *r = &kv->ns.rows[rec->ns_slot];
    r->live[rec->is_pin]--;
    r->blocks -= rec->len;
    rec->live = 0;
    rec->len = rec->num_tokens = rec->cached_tokens = 0;
    rec->buffer = rec->retired = NULL;
    rec->bucket_tokens = 0;
    rec->is_pin = 0;
    rec->key_kind = KVA_KV_KEY_NONE;
    if (++rec->generation == 0) rec->generation = 1;
    rec->next_free = kv->free_slot;
    kv->free_slot = (uint32_t)(rec - kv->seqs);
}
