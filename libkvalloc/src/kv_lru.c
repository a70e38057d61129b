/*
 * kv_lru.c — the LRU lists of cached blocks, one per priority, kept in arrays.
 *
 * Why arrays. An eviction must know its next victims before it reads their records, or it waits
 * for one memory latency per victim: with the LRU as a linked list through the block records, a
 * list reshuffled by hits is a random walk through memory, and each next victim is known only
 * once the current one's record has arrived (about 170 ns per eviction at a million blocks on
 * the benchmark machine). Here each list is a doubly linked list of segments, each an array of
 * KV_LRU_SEG block ids in release order. Eviction reads the ids of the next victims from the
 * arrays (sequential memory) and then loads all their records and buckets at once.
 *
 * Entries. A release appends the block's id at the tail segment's end and records its position
 * in the block (lru_slot). A block leaving the list (a hit, or its eviction) leaves a tombstone
 * (KVA_NIL) in its entry: O(1), and the order of the others is untouched. A segment's `first`
 * skips the tombstones at its front and `fill` ends after its last live entry, so neither end
 * is rescanned and a block hit and released again at the very end of a list costs no moves.
 *
 * Bounded space. Tombstones must not accumulate, or a cache whose blocks are hit and released
 * again and again would grow its lists without bound. Three rules keep the segments dense:
 *  - a segment whose last live entry leaves is unlinked and freed, unless it is the tail, which
 *    stays (empty) for the next release: a block hit and released again and again would
 *    otherwise free and take a segment each time;
 *  - two adjacent segments that hold at most KV_LRU_SEG live entries between them merge (the
 *    side with fewer moves into the other, in order; the moved blocks' lru_slot follow), unless
 *    the second is the list's tail: so any two adjacent segments but the last two of a list hold
 *    more than KV_LRU_SEG (K4);
 *  - an append to a full tail segment compacts it in place when at most half its entries are
 *    live; otherwise a new tail follows, and the old one, no longer exempt, merges with the one
 *    before it if the two fit in one.
 * A list of m segments then holds more than floor((m - 2) / 2) * KV_LRU_SEG blocks (the tail may
 * be empty), so m is at most 2 * ceil(L / KV_LRU_SEG) + 1 for L blocks, and all lists together
 * need at most 2 * ceil(num_blocks / KV_LRU_SEG) + 3 * KVA_KV_PRIORITIES segments (and never more
 * than num_blocks + KVA_KV_PRIORITIES: every segment but a tail holds a live entry). That much
 * address space is reserved at creation, so a segment is never lacking. Segments are handed out from the bottom as they
 * are first needed (lru_used) and recycled through a free list, so the memory touched follows
 * the lists' high-water mark: at most 8.4 bytes per block for a large cache at KV_LRU_SEG = 64,
 * and no fixed cost per priority for a small one until its lists hold blocks.
 *
 * Cost. Appends and removals are O(1) but for the moves of merges and compactions, at most
 * KV_LRU_SEG entries each. The tail's exemption is what keeps those O(1) amortized: the work of
 * a list's end happens only when its tail fills, which takes at least KV_LRU_SEG / 2 appends
 * since the last time (a compaction frees at least that many entries, a new tail has all of
 * them), and costs at most KV_LRU_SEG / 2 moves for the compaction or the merge; a merge
 * elsewhere removes a segment, and segments are created only at the tail. (Without the
 * exemption a block hit and released again beside a full tail cost 63 moves every time.)
 * Nothing here reads a block record except to follow a moved entry.
 */
#include <stdlib.h>

#include "kv_cache.h"

#define SEG KV_LRU_SEG

static uint32_t segments_needed(uint32_t num_blocks) {
    uint32_t bound = 2 * ((num_blocks + SEG - 1) / SEG) + 3 * KVA_KV_PRIORITIES;
    return bound < num_blocks + KVA_KV_PRIORITIES ? bound : num_blocks + KVA_KV_PRIORITIES;
}

kva_status kv_lru_init(kva_kv *kv) {
    uint32_t count = segments_needed(kv->num_blocks);
    void *ids, *segs;
    kva_status st = kv_metadata_map((size_t)count * SEG * sizeof *kv->lru_ids, &ids, &kv->lru_ids_length);
    if (st != KVA_OK) return st;
    kv->lru_ids = ids;
    st = kv_metadata_map((size_t)count * sizeof *kv->lru_segs, &segs, &kv->lru_segs_length);
    if (st != KVA_OK) return st;
    kv->lru_segs = segs;
    kv->lru_segments = count;
    kv->lru_used = 0;
    kv->lru_free = KVA_NIL;
    for (unsigned p = 0; p < KVA_KV_PRIORITIES; p++) kv->lru_head[p] = kv->lru_tail[p] = KVA_NIL;
    return KVA_OK;
}

void kv_lru_release(kva_kv *kv) {
    if (kv->lru_ids) kva_os_unmap(kv->lru_ids, kv->lru_ids_length);
    if (kv->lru_segs) kva_os_unmap(kv->lru_segs, kv->lru_segs_length);
}

/* A free segment, or one never used (there is always one: segments_needed covers every state),
 * linked at the tail of list p. */
static uint32_t segment_append(kva_kv *kv, unsigned p) {
    uint32_t s = kv->lru_free;
    if (s != KVA_NIL) kv->lru_free = kv->lru_segs[s].next;
    else s = kv->lru_used++;
    kv_lru_seg *g = &kv->lru_segs[s];
    *g = (kv_lru_seg){.prev = kv->lru_tail[p], .next = KVA_NIL, .priority = (uint8_t)p};
    if (g->prev == KVA_NIL) kv->lru_head[p] = s;
    else kv->lru_segs[g->prev].next = s;
    kv->lru_tail[p] = s;
    return s;
}

/* Unlinks segment s from its list and frees it (fill 0). */
static void segment_free(kva_kv *kv, uint32_t s) {
    kv_lru_seg *g = &kv->lru_segs[s];
    unsigned p = g->priority;
    if (g->prev == KVA_NIL) kv->lru_head[p] = g->next;
    else kv->lru_segs[g->prev].next = g->next;
    if (g->next == KVA_NIL) kv->lru_tail[p] = g->prev;
    else kv->lru_segs[g->next].prev = g->prev;
    *g = (kv_lru_seg){.prev = KVA_NIL, .next = kv->lru_free};
    kv->lru_free = s;
}

/* Moves segment src's live entries, in order, into segment dst from entry `at` on: returns the
 * end. Each moved block's lru_slot follows its entry; those records are written, so they are
 * first all prefetched (they may be anywhere in a large cache: their misses overlap). dst may
 * be src (compaction, at <= first). */
static uint32_t move_entries(kva_kv *kv, uint32_t dst, uint32_t at, uint32_t src) {
    const kv_lru_seg *g = &kv->lru_segs[src];
    uint32_t *from = kv_lru_seg_ids(kv, src), *to = kv_lru_seg_ids(kv, dst);
    for (uint32_t i = g->first, to_at = at; i < g->fill; i++)
        if (from[i] != KVA_NIL && to + to_at++ != from + i) __builtin_prefetch(&kv->blocks[from[i]], 1);
    for (uint32_t i = g->first; i < g->fill; i++) {
        uint32_t b = from[i];
        if (b == KVA_NIL) continue;
        if (to + at != from + i) { /* a compaction leaves the entries before its first gap */
            to[at] = b;
            kv->blocks[b].lru_slot = dst * SEG + at;
        }
        at++;
    }
    return at;
}

/* Squeezes the tombstones out of segment s. */
static void compact_segment(kva_kv *kv, uint32_t s) {
    kv_lru_seg *g = &kv->lru_segs[s];
    g->fill = (uint8_t)move_entries(kv, s, 0, s); /* entries past fill are never read */
    g->first = 0;
}

/* Merges segments a and b, b the one after a, which hold at most SEG live entries together;
 * returns the one that remains. The side with fewer live entries moves: b's after a's last
 * entry when they fit there (a is compacted first when they do not), or a's just before b's
 * first live entry when the tombstones at b's front leave room, which is common after a prefix
 * spanning the two has been hit. */
static uint32_t merge(kva_kv *kv, uint32_t a, uint32_t b) {
    kv_lru_seg *ga = &kv->lru_segs[a], *gb = &kv->lru_segs[b];
    if (gb->live <= ga->live || gb->first < ga->live) {
        if (SEG - ga->fill < gb->live) compact_segment(kv, a);
        ga->fill = (uint8_t)move_entries(kv, a, ga->fill, b);
        ga->live = (uint8_t)(ga->live + gb->live);
        segment_free(kv, b);
        return a;
    }
    uint32_t at = gb->first - ga->live;
    move_entries(kv, b, at, a);
    gb->first = (uint8_t)at;
    gb->live = (uint8_t)(gb->live + ga->live);
    segment_free(kv, a);
    return b;
}

void kv_lru_settle(kva_kv *kv, uint32_t s) {
    kv_lru_seg *g = &kv->lru_segs[s];
    if (g->live == 0) {
        if (g->next == KVA_NIL) { /* the tail stays, empty */
            g->first = g->fill = 0;
            return;
        }
        uint32_t prev = g->prev, next = g->next;
        segment_free(kv, s);
        if (kv_lru_must_merge(kv, prev, next)) merge(kv, prev, next);
        return;
    }
    if (kv_lru_must_merge(kv, g->prev, s)) s = merge(kv, g->prev, s);
    while (kv_lru_must_merge(kv, s, kv->lru_segs[s].next)) s = merge(kv, s, kv->lru_segs[s].next);
}

uint32_t kv_lru_make_room(kva_kv *kv, uint32_t s, unsigned p) {
    if (s == KVA_NIL) return segment_append(kv, p);
    kv_lru_seg *g = &kv->lru_segs[s];
    if (g->live <= SEG / 2) {
        compact_segment(kv, s);
        return s;
    }
    /* s stops being the tail: the pair it ends loses its exemption from K4. */
    if (kv_lru_mergeable(kv, g->prev, s)) {
        s = merge(kv, g->prev, s);
        if (kv->lru_segs[s].fill < SEG) return s;
    }
    return segment_append(kv, p);
}

uint32_t kv_lru_collect(const kva_kv *kv, uint32_t *out, uint32_t max) {
    uint32_t n = 0;
    for (uint32_t mask = kv->lru_nonempty; mask && n < max; mask &= mask - 1)
        for (uint32_t s = kv->lru_head[__builtin_ctz(mask)]; s != KVA_NIL && n < max; s = kv->lru_segs[s].next) {
            const kv_lru_seg *g = &kv->lru_segs[s];
            const uint32_t *ids = kv_lru_seg_ids(kv, s);
            for (uint32_t i = g->first; i < g->fill && n < max; i++)
                if (ids[i] != KVA_NIL) out[n++] = ids[i];
        }
    return n;
}

void kv_lru_rename(kva_kv *kv, uint32_t (*fwd)(const kva_kv *kv, uint32_t b, uint32_t n), uint32_t n) {
    for (uint32_t s = 0; s < kv->lru_used; s++) { /* free segments have fill 0 */
        uint32_t *ids = kv_lru_seg_ids(kv, s);
        for (uint32_t i = 0; i < kv->lru_segs[s].fill; i++) ids[i] = fwd(kv, ids[i], n);
    }
}

#define BROKEN(...) kva_fail(KVA_ERR_CORRUPT, __VA_ARGS__)

static kva_status check_segment(const kva_kv *kv, uint32_t s, unsigned p, uint8_t *seen, uint32_t *count) {
    const kv_lru_seg *g = &kv->lru_segs[s];
    const uint32_t *ids = kv_lru_seg_ids(kv, s);
    if (g->priority != p) return BROKEN("K4: segment %u on LRU list %u says priority %u", s, p, g->priority);
    if (g->fill > SEG || g->first > g->fill)
        return BROKEN("K4: segment %u has first %u, fill %u", s, g->first, g->fill);
    uint32_t live = 0;
    if (g->fill > g->first && ids[g->fill - 1] == KVA_NIL)
        return BROKEN("K4: segment %u ends in a tombstone at %u", s, g->fill - 1);
    for (uint32_t i = 0; i < g->fill; i++) {
        uint32_t b = ids[i];
        if (b == KVA_NIL) continue;
        if (i < g->first) return BROKEN("K4: segment %u has block %u before its first entry %u", s, b, g->first);
        if (b >= kv->num_blocks) return BROKEN("K4: segment %u names block %u, past the end", s, b);
        const kva_kv_block *blk = &kv->blocks[b];
        if (blk->state != KV_CACHED || blk->priority != p)
            return BROKEN("K4: block %u on LRU list %u has state %u priority %u", b, p, blk->state, blk->priority);
        if (blk->lru_slot != s * SEG + i)
            return BROKEN("K4: block %u sits at %u but records %u", b, s * SEG + i, blk->lru_slot);
        if (seen[b]++) return BROKEN("K4: block %u is listed twice", b);
        live++;
    }
    if (live != g->live) return BROKEN("K4: segment %u holds %u live entries, it says %u", s, live, g->live);
    if (live == 0 && (g->next != KVA_NIL || g->fill != 0))
        return BROKEN("K4: segment %u holds no live entry but is not an empty tail", s);
    *count += live;
    return KVA_OK;
}

/* The walk over the lists; listed[s] marks each segment met, so that the free list cannot
 * name one of them too (an empty tail has fill 0 like a free segment, and the counts still add
 * up). */
static kva_status check_lists(const kva_kv *kv, uint8_t *seen, uint8_t *listed) {
    uint32_t total = 0, linked = 0;
    for (unsigned p = 0; p < KVA_KV_PRIORITIES; p++) {
        uint32_t count = 0, prev = KVA_NIL;
        for (uint32_t s = kv->lru_head[p]; s != KVA_NIL; s = kv->lru_segs[s].next) {
            if (s >= kv->lru_used) return BROKEN("K4: LRU list %u links to segment %u, past the used ones", p, s);
            if (kv->lru_segs[s].prev != prev)
                return BROKEN("K4: segment %u on LRU list %u has a wrong prev link", s, p);
            if (++linked > kv->lru_used) return BROKEN("K4: the LRU lists loop");
            listed[s] = 1;
            kva_status st = check_segment(kv, s, p, seen, &count);
            if (st != KVA_OK) return st;
            if (prev != KVA_NIL && kv->lru_segs[s].next != KVA_NIL &&
                kv->lru_segs[prev].live + kv->lru_segs[s].live <= SEG)
                return BROKEN("K4: adjacent segments %u and %u hold %u live entries, few enough to merge", prev, s,
                              kv->lru_segs[prev].live + kv->lru_segs[s].live);
            prev = s;
        }
        if (kv->lru_tail[p] != prev)
            return BROKEN("K4: LRU list %u's tail is %u, the list ends at %u", p, kv->lru_tail[p], prev);
        if (count != kv->lru_count[p])
            return BROKEN("K4: LRU list %u holds %u blocks, its count says %u", p, count, kv->lru_count[p]);
        if (((kv->lru_nonempty >> p) & 1) != (count != 0))
            return BROKEN("K4: nonempty bit %u disagrees with list %u", p, p);
        total += count;
    }
    if (kv->lru_nonempty >> KVA_KV_PRIORITIES) return BROKEN("K4: nonempty bits beyond the priorities");
    if (total != kv->cached_count) return BROKEN("K4: %u blocks on the LRU lists, %u cached", total, kv->cached_count);
    uint32_t free_segments = 0;
    for (uint32_t s = kv->lru_free; s != KVA_NIL; s = kv->lru_segs[s].next) {
        if (s >= kv->lru_used) return BROKEN("K4: the free-segment list links to %u, past the used ones", s);
        if (listed[s]) return BROKEN("K4: segment %u is on an LRU list and on the free-segment list", s);
        if (kv->lru_segs[s].fill != 0) return BROKEN("K4: free segment %u has fill %u", s, kv->lru_segs[s].fill);
        if (++free_segments > kv->lru_used) return BROKEN("K4: the free-segment list loops");
    }
    if (linked + free_segments != kv->lru_used) /* lru_used <= lru_segments: kv_lru_check */
        return BROKEN("K4: %u segments listed and %u free; %u used of %u", linked, free_segments, kv->lru_used,
                      kv->lru_segments);
    return KVA_OK;
}

kva_status kv_lru_check(const kva_kv *kv, uint8_t *seen) {
    if (kv->lru_used > kv->lru_segments) return BROKEN("K4: %u segments used of %u", kv->lru_used, kv->lru_segments);
    uint8_t *listed = calloc((size_t)kv->lru_used + 1, 1);
    if (!listed) return kva_fail(KVA_ERR_NOMEM, "no host memory to check %u LRU segments", kv->lru_used);
    kva_status st = check_lists(kv, seen, listed);
    free(listed);
    return st;
}
