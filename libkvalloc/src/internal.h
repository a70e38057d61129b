/*
 * internal.h — small helpers shared by every file of the library. Nothing here is public.
 */
#ifndef KVA_INTERNAL_H
#define KVA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvalloc.h"

#define kva_likely(x) __builtin_expect(!!(x), 1)
#define kva_unlikely(x) __builtin_expect(!!(x), 0)
/* Makes the compiler treat a computed pointer as opaque, so that every field is addressed from
 * that one register (otherwise GCC re-derives the address of an asm operand from its parts: three
 * more instructions on the allocation fast path). */
#define kva_opaque(p) __asm__("" : "+r"(p))
/* The public fast paths (kva_alloc, kva_free) start on a cache line of their own, so that their
 * speed does not hang on where the linker happened to place them. */
#define KVA_HOT_ENTRY __attribute__((aligned(64)))
#define KVA_NOINLINE __attribute__((noinline))
#define KVA_INLINE static inline __attribute__((always_inline))

/* Words that one thread writes while others may read them (a thread cache's bitmap words, its
 * counters, the owner of a word) go through these: on x86-64 and AArch64 they are the plain
 * loads and stores a single-threaded build would emit, and they keep the concurrent reads
 * well defined (and ThreadSanitizer quiet). */
#define kva_load(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define kva_store(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
/* A counter only its owning thread increments, read by others: no atomic read-modify-write
 * needed. */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVA_HAS_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define KVA_HAS_TSAN 1
#endif
#if defined(__x86_64__) && !defined(KVA_HAS_TSAN)
/* One add to memory rather than a load, an add and a store: an aligned 8-byte add is never
 * seen torn by a reader. (Hidden from ThreadSanitizer, so TSan builds use the atomic pair.) */
#define kva_bump(p)                                                          \
    do {                                                                     \
        _Static_assert(sizeof *(p) == 8, "kva_bump counts in 64-bit words"); \
        __asm__("addq $1, %0" : "+m"(*(p)));                                 \
    } while (0)
#else
#define kva_bump(p) kva_store((p), kva_load(p) + 1)
#endif

/* kva_bump with release order: a reader that reads the new count with acquire sees everything
 * the thread did before the count, its taking of the object it counts included (the free
 * counts, which kva_tc_totals_locked reads before the allocation counts). On
 * x86-64 that is the same add, since stores there are never reordered with earlier loads or
 * stores: only the compiler is told. */
#if defined(__x86_64__) && !defined(KVA_HAS_TSAN)
#define kva_bump_release(p)                      \
    do {                                         \
        __atomic_signal_fence(__ATOMIC_RELEASE); \
        kva_bump(p);                             \
    } while (0)
#else
#define kva_bump_release(p) __atomic_store_n((p), kva_load(p) + 1, __ATOMIC_RELEASE)
#endif

/* Adds n to a counter only the calling thread writes, with release order as kva_bump_release;
 * nothing is stored when n is 0 (the remote frees a merge found, mostly none). */
KVA_INLINE void kva_add_release(uint64_t *counter, uint64_t n) {
    if (n) __atomic_store_n(counter, kva_load(counter) + n, __ATOMIC_RELEASE);
}

/* The "no index" value of every u32 index list. */
#define KVA_NIL UINT32_MAX

KVA_INLINE int kva_is_pow2(size_t x) { return x != 0 && (x & (x - 1)) == 0; }
KVA_INLINE unsigned kva_log2(size_t x) { return 63u - (unsigned)__builtin_clzll((unsigned long long)x); }
KVA_INLINE unsigned kva_ctz64(uint64_t x) { return (unsigned)__builtin_ctzll(x); }

/*
 * Assertions, at three levels as mimalloc's, chosen by KVA_DEBUG (CMake: 0 in Release, 3 in
 * Debug, which the sanitizer builds are):
 *   kva_assert(e)           1+  cheap facts at the public boundary: what a call hands back;
 *   kva_assert_internal(e)  2+  cheap invariants on the fast paths: an object's bit, a buddy
 *                               order in range, a list's links, a word's owner;
 *   kva_assert_expensive(e) 3+  a layer's checker (buddy_check.c, slab_check.c, tcache_check.c)
 *                               after a slow path: a buddy split or merge, a slab made or
 *                               released, a trim, a refill. They walk whole structures, so at
 *                               run time they run only where the environment sets
 *                               KVA_DEBUG_EXPENSIVE=1 (the tests labelled expensive do).
 * Level 0 compiles every one to nothing: the expression is never evaluated (sizeof only sees
 * it, so that what it names counts as used). A failed assertion prints file, line, function and
 * the expression to stderr and aborts: the one place the library prints or aborts, in debug
 * builds only, since a broken invariant means the metadata can no longer be trusted.
 */
#ifndef KVA_DEBUG
#define KVA_DEBUG 0
#endif
#define KVA_ASSERT_OFF(e) ((void)sizeof(!(e)))
#if KVA_DEBUG >= 1
void kva_assert_fail(const char *expr, const char *file, int line, const char *func)
    __attribute__((noreturn, cold, noinline));
/* The text is taken where the assertion is written, before its macros (KVA_NIL, say) expand. */
#define KVA_ASSERT_ON(e, text) (kva_likely(e) ? (void)0 : kva_assert_fail(text, __FILE__, __LINE__, __func__))
#define kva_assert(e) KVA_ASSERT_ON(e, #e)
#else
#define kva_assert(e) KVA_ASSERT_OFF(e)
#endif
#if KVA_DEBUG >= 2
#define kva_assert_internal(e) KVA_ASSERT_ON(e, #e)
#else
#define kva_assert_internal(e) KVA_ASSERT_OFF(e)
#endif
#if KVA_DEBUG >= 3
extern int kva_debug_expensive; /* KVA_DEBUG_EXPENSIVE=1 in the environment at load time */
#define kva_assert_expensive(e) (kva_unlikely(kva_debug_expensive) ? KVA_ASSERT_ON(e, #e) : (void)0)
#else
#define kva_assert_expensive(e) KVA_ASSERT_OFF(e)
#endif

/*
 * Records why the calling thread's current call failed (kva_last_error) and returns status,
 * so error paths read `return kva_fail(KVA_ERR_INVALID, "min_block %zu ...", v);`.
 * Cold by construction: only error paths call it.
 */
kva_status kva_fail(kva_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3), cold, noinline));

#endif
