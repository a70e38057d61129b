/*
 * checked_mode.c — the checked mode of a pool (checked_mode.h): the free poison and the red-zone
 * bytes, a checked allocation's red zones and size, the quarantine of blocks written after free,
 * and why a checked free is refused.
 */
#include <stdlib.h>
#include <string.h>

#include "checked_mode.h"
#include "pool.h"

void kva_poison(unsigned char *p, size_t n) { memset(p, KVA_POISON_FREE, n); }

int kva_holds(const unsigned char *p, size_t n, unsigned char pattern, size_t *bad) {
    /* A word at a time: a checked pool verifies whole blocks on every allocation. */
    uint64_t word;
    memset(&word, pattern, sizeof word);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        if (v != word) break;
    }
    for (; i < n; i++)
        if (p[i] != pattern) {
            *bad = i;
            return 0;
        }
    return 1;
}

/* ---- red zones, poison verified on the way out and in ------------------------------------- */

/* The allocation behind a checked pool's pointer starts a red zone earlier. */
static unsigned char *guarded_start(const void *ptr) { return (unsigned char *)ptr - KVA_REDZONE; }

/* The size asked for, which the front red zone keeps inverted (kva_checked_alloc). */
static uint64_t stored_size(const unsigned char *start) {
    uint64_t stored;
    memcpy(&stored, start, sizeof stored);
    return ~stored;
}

/* Lists the block at start in the quarantine: 0 when there is no host memory for the entry. */
static int quarantine_add(kva_pool *pool, const unsigned char *start) {
    pthread_mutex_lock(&pool->lock);
    int listed = 1;
    if (pool->quarantined == pool->quarantine_room) {
        uint32_t room = pool->quarantine_room ? 2 * pool->quarantine_room : 8;
        uint64_t *grown = room > pool->quarantine_room ? realloc(pool->quarantine, room * sizeof *grown) : NULL;
        if (grown) {
            pool->quarantine = grown;
            pool->quarantine_room = room;
        } else {
            listed = 0;
        }
    }
    if (listed) pool->quarantine[pool->quarantined++] = (uint64_t)(start - pool->base);
    pthread_mutex_unlock(&pool->lock);
    return listed;
}

/* Whether the block at start is withheld. A scan: the quarantine holds one entry per write
 * after free found, a bug each, not a number that grows with the pool's use. */
static int quarantined(kva_pool *pool, const unsigned char *start) {
    uint64_t offset = (uint64_t)(start - pool->base);
    pthread_mutex_lock(&pool->lock);
    int found = 0;
    for (uint32_t i = 0; i < pool->quarantined && !found; i++) found = pool->quarantine[i] == offset;
    pthread_mutex_unlock(&pool->lock);
    return found;
}

kva_status kva_checked_alloc(kva_pool *pool, size_t size, void **out,
                             kva_status (*alloc)(kva_pool *, size_t, void **)) {
    if (!out || size == 0) return alloc(pool, size, out);
    if (size > pool->max_alloc_size - 2 * KVA_REDZONE)
        return kva_pool_reject(pool, kva_fail(KVA_ERR_INVALID,
                                              "size %zu and its two red zones exceed the largest "
                                              "block (%zu)",
                                              size, pool->max_alloc_size));
    void *got;
    kva_status st = alloc(pool, size + 2 * KVA_REDZONE, &got);
    if (st != KVA_OK) return st;
    unsigned char *start = got;
    size_t usable = kva_pool_usable(pool, start), bad;
    if (!kva_holds(start, usable, KVA_POISON_FREE, &bad)) {
        /* Nothing is handed out. The block is withheld as it is, so that what was written
         * stays for a debugger, kva_check keeps reporting it, and the stale pointer that
         * wrote it can never reach a live object; with no memory to list it, it is cleaned
         * and freed instead. */
        uint64_t at = (uint64_t)(start + bad - pool->base);
        if (!quarantine_add(pool, start)) {
            kva_poison(start, usable);
            kva_pool_free_plain(pool, start);
            __atomic_fetch_add(&pool->retracted_allocs, 1, __ATOMIC_RELAXED);
        }
        return kva_fail(KVA_ERR_CORRUPT,
                        "write after free: byte %llu of the pool, in freed memory, was changed (the block at %llu is "
                        "withheld)",
                        (unsigned long long)at, (unsigned long long)(start - pool->base));
    }
    /* The front red zone keeps the requested size (inverted, so an overwrite shows), which puts
     * the back red zone right after the last requested byte: the block's slack is red zone too. */
    uint64_t stored = ~(uint64_t)size;
    memcpy(start, &stored, sizeof stored);
    memset(start + sizeof stored, KVA_POISON_REDZONE, KVA_REDZONE - sizeof stored);
    memset(start + KVA_REDZONE + size, KVA_POISON_REDZONE, usable - KVA_REDZONE - size);
    *out = start + KVA_REDZONE;
    return KVA_OK;
}

/* Why ptr, inside the pool but no checked allocation's start, cannot be freed, judged by ptr
 * itself: the address a red zone before it belongs to something else (the end of a freed
 * block before a live one, the red zone of a live object after a free one). Changes nothing. */
static kva_status classify_not_an_allocation(kva_pool *pool, const void *ptr, uint64_t offset) {
    if (__atomic_load_n(&pool->slabs.slabs[kva_slab_chunk(&pool->slabs, offset)].cls, __ATOMIC_ACQUIRE) !=
        KVA_SLAB_NONE)
        return kva_pool_classify_slab_interior(pool, ptr, offset);
    pthread_mutex_lock(&pool->lock);
    kva_status st = kva_pool_classify_bad_free(pool, ptr, offset);
    pthread_mutex_unlock(&pool->lock);
    return st;
}

kva_status kva_checked_free(kva_pool *pool, void *ptr) {
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
    if (!ptr || offset >= pool->capacity) return kva_pool_free_plain(pool, ptr);
    if (offset < KVA_REDZONE) /* every allocation of a checked pool starts past a red zone */
        return kva_pool_reject(pool, kva_fail(KVA_ERR_BAD_POINTER,
                                              "%p is not an allocation: in a checked pool "
                                              "they start %d bytes into their block",
                                              ptr, KVA_REDZONE));
    unsigned char *start = guarded_start(ptr);
    if (quarantined(pool, start))
        return kva_pool_reject(pool, kva_fail(KVA_ERR_DOUBLE_FREE,
                                              "%p was freed already, then written after that free "
                                              "(the block is withheld)",
                                              ptr));
    size_t usable = kva_pool_usable(pool, start), bad;
    if (usable == 0) return kva_pool_reject(pool, classify_not_an_allocation(pool, ptr, offset));
    const char *overrun = NULL;
    uint64_t size = stored_size(start);
    if (size > usable - 2 * KVA_REDZONE ||
        !kva_holds(start + sizeof size, KVA_REDZONE - sizeof size, KVA_POISON_REDZONE, &bad))
        overrun = "before its start";
    else if (!kva_holds(start + KVA_REDZONE + size, usable - KVA_REDZONE - size, KVA_POISON_REDZONE, &bad))
        overrun = "past its end";
    kva_poison(start, usable);
    kva_status st = kva_pool_free_plain(pool, start);
    if (st == KVA_OK && overrun)
        return kva_fail(KVA_ERR_CORRUPT, "%p: a write %s ran into the red zone (the memory is freed)", ptr, overrun);
    return st;
}

size_t kva_checked_usable_size(kva_pool *pool, const void *ptr) {
    /* In integers first: a foreign pointer's arithmetic could overflow. */
    uint64_t offset = (uintptr_t)ptr - (uintptr_t)pool->base;
    if (offset < KVA_REDZONE || offset >= pool->capacity) return 0;
    const unsigned char *start = pool->base + (offset - KVA_REDZONE);
    size_t usable = kva_pool_usable(pool, start);
    if (!usable || quarantined(pool, start)) return 0;
    /* What may be written: the requested size, kept in the front red zone; past it begins the
     * back red zone (a corrupted front one cannot say more than the block holds). */
    uint64_t size = stored_size(start);
    return size < usable - 2 * KVA_REDZONE ? (size_t)size : usable - 2 * KVA_REDZONE;
}
