/*
 * kv_ns.c — each namespace's share of the cache (kva_kv_namespaces) and the pinned blocks, both
 * kept exact as the cache changes, and their invariants (K11, K12 in kv_cache.h).
 *
 * The namespace table has KVA_KV_NAMESPACE_SLOTS rows for namespaces of their own and one row,
 * KV_NS_OTHER, for all the others. The rows change where the figures change: a sequence or pin
 * made live (kv_seq_publish) or retired (kv_seq_retire) and a sequence's growth (extend) through
 * the row its record keeps (ns_slot); a registration (kv_commit) and its drop (the prefix
 * table's unregister, kva_kv_reset_prefix_cache) through kv_ns_slot, a compare against the
 * namespace of the last lookup and, past it, a probe of the index here (a hash table of the
 * assigned slots): a namespace without a slot, counted in the other row, costs no walk of the
 * slots, nor do calls whose namespaces change from one to the next.
 *
 * The rule that keeps every row exact: a namespace with no slot gets one when it is seen while
 * the other row is all zero, a never-used slot first, else one whose counts are all zero (its
 * namespace then has nothing anywhere). While the other row holds anything no slot changes
 * hands, so the namespaces counted there have no slot, and a namespace is counted in one row.
 * Lookups for a decrement go through the same function: a namespace without a slot has its
 * counts in the other row, which is then not zero, so no slot is given.
 */
#include <stdlib.h>
#include <string.h>

#include "kv_cache.h"

static int row_empty(const kv_ns_row *r) { return (r->live[0] | r->live[1] | r->blocks | r->registered) == 0; }

/* ---- the index: the assigned slots by namespace hash (linear probing, K12) ---------------- */

_Static_assert(KV_NS_INDEX > KVA_KV_NAMESPACE_SLOTS && (KV_NS_INDEX & (KV_NS_INDEX - 1)) == 0,
               "the index has a hole at any time, and a mask");
_Static_assert(KV_NS_OTHER < KV_NS_HOLE, "a slot number fits an entry");

/* The index position holding ns's slot, or the hole its probe ends at. */
static uint32_t ns_probe(const kv_ns_table *t, uint64_t ns) {
    uint32_t h = kv_ns_home(ns);
    while (t->index[h] != KV_NS_HOLE && t->rows[t->index[h]].ns != ns) h = (h + 1) & (KV_NS_INDEX - 1);
    return h;
}

/* Takes slot s's namespace out of the index: each entry after it in its run moves into the hole
 * when the hole lies on that entry's probe path (from its home up to where it is). */
static void index_remove(kv_ns_table *t, uint32_t s) {
    uint32_t hole = ns_probe(t, t->rows[s].ns);
    for (uint32_t j = (hole + 1) & (KV_NS_INDEX - 1); t->index[j] != KV_NS_HOLE; j = (j + 1) & (KV_NS_INDEX - 1)) {
        uint32_t home = kv_ns_home(t->rows[t->index[j]].ns);
        if (((j - home) & (KV_NS_INDEX - 1)) >= ((j - hole) & (KV_NS_INDEX - 1))) {
            t->index[hole] = t->index[j];
            hole = j;
        }
    }
    t->index[hole] = KV_NS_HOLE;
}

/* Namespace 0, everyone's default, holds slot 0 from the start (until another namespace needs
 * the slot while it is empty), and the memo names it: kv_ns_slot's one compare needs a memo
 * that always names a slot. */
void kv_ns_init(kva_kv *kv) {
    memset(&kv->ns, 0, sizeof kv->ns);
    memset(kv->ns.index, KV_NS_HOLE, sizeof kv->ns.index);
    kv->ns.assigned = 1;
    kv->ns.memo = 0;
    kv->ns.memo_ns = 0;
    kv->ns.index[kv_ns_home(0)] = 0;
}

uint32_t kv_ns_lookup(kva_kv *kv, uint64_t ns) {
    kv_ns_table *t = &kv->ns;
    uint32_t at = ns_probe(t, ns), s = t->index[at];
    if (s == KV_NS_HOLE) {
        if (!row_empty(&t->rows[KV_NS_OTHER])) return KV_NS_OTHER;
        if (t->assigned < KV_NS_OTHER) {
            s = t->assigned++;
        } else {
            t->scans++;
            for (s = 0; s < KV_NS_OTHER && !row_empty(&t->rows[s]); s++) {
            }
            if (s == KV_NS_OTHER) return KV_NS_OTHER;
            index_remove(t, s);
            at = ns_probe(t, ns); /* the removal may have moved the hole */
        }
        t->rows[s].ns = ns;
        t->index[at] = (uint8_t)s;
    }
    t->memo = s;
    t->memo_ns = ns;
    return s;
}

void kv_ns_forget_all(kva_kv *kv) {
    for (uint32_t s = 0; s <= KV_NS_OTHER; s++) kv->ns.rows[s].registered = 0;
}

/* The slot holding ns by a plain search (no memo, no assignment), or KV_NS_OTHER. */
static uint32_t slot_of(const kva_kv *kv, uint64_t ns) {
    for (uint32_t s = 0; s < kv->ns.assigned; s++)
        if (kv->ns.rows[s].ns == ns) return s;
    return KV_NS_OTHER;
}

void kv_pin_hold(kva_kv *kv, const uint32_t *table, uint32_t n) {
    if (n) kv->pins_touched = 1;
    for (uint32_t i = 0; i < n; i++) kv->pinned_count += kv->pin_refs[table[i]]++ == 0;
}

void kv_pin_drop(kva_kv *kv, const uint32_t *table, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) kv->pinned_count -= --kv->pin_refs[table[i]] == 0;
}

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

kva_status kv_ns_check(const kva_kv *kv) {
    const kv_ns_table *t = &kv->ns;
    if (t->assigned == 0 || t->assigned > KV_NS_OTHER)
        return BROKEN("K12: %u namespace slots assigned of %u", t->assigned, KV_NS_OTHER);
    for (uint32_t s = 0; s < t->assigned; s++)
        for (uint32_t o = s + 1; o < t->assigned; o++)
            if (t->rows[s].ns == t->rows[o].ns)
                return BROKEN("K12: slots %u and %u both hold namespace %llu", s, o, (unsigned long long)t->rows[s].ns);
    for (uint32_t s = t->assigned; s < KV_NS_OTHER; s++)
        if (!row_empty(&t->rows[s]) || t->rows[s].ns) return BROKEN("K12: unassigned namespace slot %u is not zero", s);
    if (!row_empty(&t->rows[KV_NS_OTHER]) && t->assigned < KV_NS_OTHER)
        return BROKEN("K12: the other row counts namespaces while %u slots are unassigned", KV_NS_OTHER - t->assigned);
    uint32_t indexed = 0;
    for (uint32_t h = 0; h < KV_NS_INDEX; h++) {
        uint32_t s = t->index[h];
        if (s == KV_NS_HOLE) continue;
        indexed++;
        if (s >= t->assigned || t->index[ns_probe(t, t->rows[s].ns)] != s)
            return BROKEN("K12: index entry %u names slot %u, which a probe for its namespace does not find", h, s);
    }
    if (indexed != t->assigned) return BROKEN("K12: the index holds %u slots of %u assigned", indexed, t->assigned);
    if (t->memo >= t->assigned || t->rows[t->memo].ns != t->memo_ns)
        return BROKEN("K12: the memo names slot %u for namespace %llu, which it does not hold", t->memo,
                      (unsigned long long)t->memo_ns);
    kv_ns_row want[KV_NS_OTHER + 1];
    memset(want, 0, sizeof want);
    for (uint32_t i = 0; i < kv->seq_slots; i++) {
        const kva_kv_seqrec *rec = &kv->seqs[i];
        if (!rec->live) continue;
        uint32_t s = slot_of(kv, rec->ns);
        if (rec->ns_slot != s)
            return BROKEN("K12: sequence in slot %u of namespace %llu counts in row %u; its namespace's is %u", i,
                          (unsigned long long)rec->ns, rec->ns_slot, s);
        want[s].live[rec->is_pin ? 1 : 0]++;
        want[s].blocks += rec->len;
    }
    if (kv->info.mode == KVA_KV_PAGED)
        for (uint32_t b = 0; b < kv->num_blocks; b++)
            if (kv->blocks[b].registered) want[slot_of(kv, kv->blocks[b].ns)].registered++;
    for (uint32_t s = 0; s <= KV_NS_OTHER; s++) {
        const kv_ns_row *r = &t->rows[s], *w = &want[s];
        if (r->live[0] != w->live[0] || r->live[1] != w->live[1] || r->blocks != w->blocks ||
            r->registered != w->registered)
            return BROKEN("K12: namespace row %u counts %u sequences, %u pins, %llu blocks, %llu registered; the cache "
                          "has %u, %u, %llu, %llu",
                          s, r->live[0], r->live[1], (unsigned long long)r->blocks, (unsigned long long)r->registered,
                          w->live[0], w->live[1], (unsigned long long)w->blocks, (unsigned long long)w->registered);
    }
    return KVA_OK;
}

kva_status kv_pins_check(const kva_kv *kv) {
    if (kv->info.mode != KVA_KV_PAGED) return KVA_OK;
    /* Counted down from pin_refs, entry by entry: any block left nonzero, or going below zero,
     * has a count other than its pins' entries. */
    uint32_t pinned = 0;
    for (uint32_t b = 0; kv->pins_touched && b < kv->num_blocks; b++) pinned += kv->pin_refs[b] != 0;
    if (pinned != kv->pinned_count)
        return BROKEN("K11: %u blocks have pin references, the counter says %u", pinned, kv->pinned_count);
    uint32_t *left = NULL;
    if (kv->pins_touched) {
        left = malloc((size_t)kv->num_blocks * sizeof *left);
        if (!left) return kva_fail(KVA_ERR_NOMEM, "no host memory to check %u blocks", kv->num_blocks);
        memcpy(left, kv->pin_refs, (size_t)kv->num_blocks * sizeof *left);
    }
    kva_status st = KVA_OK;
    for (uint32_t i = 0; st == KVA_OK && i < kv->seq_slots; i++) {
        const kva_kv_seqrec *rec = &kv->seqs[i];
        if (!rec->live || !rec->is_pin) continue;
        for (uint32_t j = 0; st == KVA_OK && j < rec->len; j++) {
            uint32_t b = rec->table[j];
            if (!left || left[b] == 0) st = BROKEN("K11: pin in slot %u names block %u beyond its pin count", i, b);
            else left[b]--;
        }
    }
    for (uint32_t b = 0; st == KVA_OK && left && b < kv->num_blocks; b++)
        if (left[b]) st = BROKEN("K11: block %u counts %u pin references no pin holds", b, left[b]);
    free(left);
    return st;
}

static kva_status namespaces_locked(kva_kv *kv, kva_kv_namespace_share *out, uint32_t max, uint32_t *count) {
    if (!count) return kv_reject(kv, kva_fail(KVA_ERR_INVALID, "count is NULL"));
    if (!out && max) return kv_reject(kv, kva_fail(KVA_ERR_INVALID, "out is NULL with max %u", max));
    uint32_t n = 0;
    for (uint32_t s = 0; s <= KV_NS_OTHER; s++) {
        const kv_ns_row *r = &kv->ns.rows[s];
        if (row_empty(r) || (s < KV_NS_OTHER && s >= kv->ns.assigned)) continue;
        if (n < max)
            out[n] = (kva_kv_namespace_share){.namespace_id = s == KV_NS_OTHER ? 0 : r->ns,
                                              .is_other = s == KV_NS_OTHER,
                                              .sequences = r->live[0],
                                              .pins = r->live[1],
                                              .blocks = r->blocks,
                                              .registered_blocks = r->registered};
        n++;
    }
    *count = n;
    return KVA_OK;
}

kva_status kva_kv_namespaces(kva_kv *kv, kva_kv_namespace_share *out, uint32_t max, uint32_t *count) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kv_lock(kv, KVA_KV_CALL_OTHER);
    kva_status st = namespaces_locked(kv, out, max, count);
    kv_unlock(kv);
    return st;
}
