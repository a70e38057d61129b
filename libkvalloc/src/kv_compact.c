/*
 * kv_compact.c — kva_kv_compact: moves the blocks that hold data (USED and CACHED) to the lowest
 * ids so that the free blocks are the top ids, the tail of the KV memory (of each layer's
 * region in the layers layout), which can then be handed back as whole chunks.
 *
 * With n = used_count + cached_count blocks holding data, the blocks at ids >= n that hold data
 * are exactly as many as the free ids < n ("holes"). Pairing them in ascending order, the i-th
 * such block moves to the i-th hole: the fewest moves possible (a block below n never moves),
 * and no id is both a source and a destination, so the engine may copy in any order.
 *
 * The work is in passes over metadata only (the KV memory is never touched: it may be GPU
 * memory, and the engine copies):
 *   1. count the moves; refuse (nothing changed) if the caller's array is too small;
 *   2. copy each source's record, its loose count and its engine key to its hole and leave a
 *      forwarding id in the source's `next` (every source is above n and becomes free in pass
 *      5, so its record is scratch);
 *   3. rewrite the links of the records now in [0, n): the prefix-chain link of registered
 *      ones; then the bucket heads that named a source (a source's bucket follows from its
 *      key) and the ids in the LRU segments (a CACHED block's lru_slot, its position there,
 *      moved with its record);
 *   4. rewrite every live sequence's and pin's table entries >= n;
 *   5. rebuild [n, num_blocks) as free records, stacked n, n+1, ... from the top (as at
 *      creation, so later allocations fill the low ids first).
 * Every reference to a block holding data names a block in [0, n) after pass 2 through the
 * forwarding ids, and nothing needs host memory, so compaction cannot fail halfway.
 * O(num_blocks + table entries) under the lock.
 */
#include <string.h>

#include "kv_cache.h"

#define INVALID(...) kv_reject(kv, kva_fail(KVA_ERR_INVALID, __VA_ARGS__))

/* The id a block has after pass 2: unchanged below n, else the hole it moved to. */
static uint32_t forward(const kva_kv *kv, uint32_t b, uint32_t n) {
    return b == KVA_NIL || b < n ? b : kv->blocks[b].next;
}

/* Moves the blocks holding data at ids >= n into the holes below n; fills moves[0 .. count). */
static void move_records(kva_kv *kv, uint32_t n, kva_kv_move *moves) {
    uint32_t hole = 0, src = n, i = 0;
    for (;; i++) {
        while (src < kv->backed_blocks && kv->blocks[src].state == KV_FREE) src++;
        if (src >= kv->backed_blocks) break;              /* trimmed blocks hold nothing */
        while (kv->blocks[hole].state != KV_FREE) hole++; /* below n: as many holes as sources */
        kv->blocks[hole] = kv->blocks[src];
        kv->blocks[src].next = hole;
        /* The engine's references and key bytes go with the block. */
        kv->loose[hole] = kv->loose[src];
        kv->loose[src] = 0;
        if (kv->pins_touched) { /* and its pins' references (K11) */
            kv->pin_refs[hole] = kv->pin_refs[src];
            kv->pin_refs[src] = 0;
        }
        if (kv->blocks[hole].registered && kv->blocks[hole].key_len)
            memcpy(kv_key_store(kv, hole), kv_key_store(kv, src), kv->blocks[hole].key_len);
        moves[i] = (kva_kv_move){src, hole};
        hole++;
        src++;
    }
}

static void relink(kva_kv *kv, uint32_t n, const kva_kv_move *moves, uint32_t count) {
    for (uint32_t b = 0; b < n; b++) {
        kva_kv_block *blk = &kv->blocks[b];
        if (blk->registered) blk->hash_next = forward(kv, blk->hash_next, n);
    }
    for (uint32_t i = 0; i < count; i++) {
        const kva_kv_block *blk = &kv->blocks[moves[i].dst_block];
        if (!blk->registered) continue;
        uint32_t *head = &kv->buckets[blk->key.lo & kv->bucket_mask];
        if (*head == moves[i].src_block) *head = moves[i].dst_block;
    }
    kv_lru_rename(kv, forward, n);
}

static void rewrite_tables(kva_kv *kv, uint32_t n) {
    for (uint32_t s = 0; s < kv->seq_slots; s++) {
        kva_kv_seqrec *rec = &kv->seqs[s];
        if (!rec->live) continue;
        for (uint32_t i = 0; i < rec->len; i++) rec->table[i] = forward(kv, rec->table[i], n);
    }
}

static void rebuild_free(kva_kv *kv, uint32_t n) {
    uint32_t total = kv->backed_blocks; /* the trimmed blocks above stay trimmed */
    for (uint32_t b = n; b < total; b++)
        kv->blocks[b] =
            (kva_kv_block){.refs = 0, .hash_next = KVA_NIL, .next = b + 1 < total ? b + 1 : KVA_NIL, .state = KV_FREE};
    kv->free_top = n < total ? n : KVA_NIL;
    kv->free_bottom = n < total ? total - 1 : KVA_NIL;
}

static kva_status compact(kva_kv *kv, kva_kv_move *moves, uint32_t capacity, uint32_t *count) {
    uint32_t n = kv->used_count + kv->cached_count, needed = 0;
    for (uint32_t b = n; b < kv->backed_blocks; b++) needed += kv->blocks[b].state != KV_FREE;
    *count = needed;
    if (!moves) capacity = 0;
    if (needed > capacity)
        return kva_fail(KVA_ERR_NOMEM, "compaction needs %u moves; the array holds %u", needed, capacity);
    move_records(kv, n, moves);
    relink(kv, n, moves, needed);
    rewrite_tables(kv, n);
    rebuild_free(kv, n);
    kv->counters.moves += needed;
    kv->counters.moved_bytes += (uint64_t)needed * kv->info.block_bytes;
    return KVA_OK;
}

static kva_status compact_locked(kva_kv *kv, kva_kv_move *moves, uint32_t capacity, uint32_t *count) {
    if (!count) return INVALID("count is NULL");
    if (kv->info.mode != KVA_KV_PAGED) return INVALID("compaction needs paged mode; this cache is contiguous");
    return compact(kv, moves, capacity, count);
}

kva_status kva_kv_compact(kva_kv *kv, kva_kv_move *moves, uint32_t capacity, uint32_t *count) {
    if (!kv) return kva_fail(KVA_ERR_INVALID, "cache is NULL");
    kva_status st = kv_lock_to_change(kv, KVA_KV_CALL_OTHER);
    if (st == KVA_OK) st = compact_locked(kv, moves, capacity, count);
    kv_unlock(kv);
    return st;
}
