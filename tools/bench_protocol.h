/*
 * bench_protocol.h — what the bench_alloc parent and its child processes agree on.
 *
 * The parent measures nothing itself. It starts one child per (allocator, pattern) as
 *     bench_alloc --child NAME --pattern PATTERN [--rounds N] [--reps K] [--samples S]
 *                 [--prefault 0|1]
 * because a general-purpose allocator is only measured honestly when it replaces malloc for
 * the whole process (LD_PRELOAD, set by the parent), and because a fresh process gives every
 * first-touch measurement memory the kernel has never handed out before.
 *
 * A child reports on stdout, one JSON object per line, always in exactly this shape:
 *     {"allocator":"jemalloc","metric":"batch64_ns_per_op","value":4.213}
 * and exits 0. On any failure it says why on stderr and exits nonzero; the parent then stops,
 * since a partial comparison would read as a complete one. Lines that do not start with '{'
 * are not reports (the syscall check writes its markers there) and are ignored.
 */
#ifndef BENCH_PROTOCOL_H
#define BENCH_PROTOCOL_H

enum bench_allocator {
    BENCH_GLIBC,
    BENCH_JEMALLOC,
    BENCH_MIMALLOC,
    BENCH_TCMALLOC,
    BENCH_KVALLOC,
    BENCH_ALLOCATOR_COUNT
};

struct bench_allocator_info {
    const char *name;
    /* The shared object the parent preloads; NULL when nothing is preloaded. */
    const char *soname;
    /* A symbol only this allocator defines: the child's proof that the preload took effect. */
    const char *marker_symbol;
    /* A substring of the path of the object that must define malloc in the child. */
    const char *malloc_owner;
    /* The Debian package that ships the library, for the version in the report. */
    const char *package;
};

/* tcmalloc is gperftools' tcmalloc_minimal: the allocator without the heap profiler, which is
 * the variant a server links when it only wants the allocator. */
static const struct bench_allocator_info bench_allocators[BENCH_ALLOCATOR_COUNT] = {
    [BENCH_GLIBC] = {"glibc", NULL, NULL, "libc.so", "libc6"},
    [BENCH_JEMALLOC] = {"jemalloc", "libjemalloc.so.2", "mallocx", "jemalloc", "libjemalloc2"},
    [BENCH_MIMALLOC] = {"mimalloc", "libmimalloc.so.2", "mi_malloc", "mimalloc", "libmimalloc2.0"},
    [BENCH_TCMALLOC] = {"tcmalloc", "libtcmalloc_minimal.so.4", "tc_malloc", "tcmalloc",
                        "libtcmalloc-minimal4"},
    /* libkvalloc is called directly through kva_alloc/kva_free; malloc stays glibc's. */
    [BENCH_KVALLOC] = {"kvalloc", NULL, NULL, "libc.so", "libkvalloc"},
};

enum bench_metric {
    BENCH_BATCH64_NS,       /* 64 B: 1,000 allocs then 1,000 frees, ns per op (either kind) */
    BENCH_BATCH64_ALLOC_NS, /* the same rounds, ns per alloc only */
    BENCH_BATCH64_FREE_NS,  /* the same rounds, ns per free only */
    BENCH_BATCH64_FAULTS,   /* minor page faults in the measured rounds, all of them */
    BENCH_BATCH4K_NS,       /* as above with 4096 B */
    BENCH_BATCH4K_ALLOC_NS,
    BENCH_BATCH4K_FREE_NS,
    BENCH_BATCH4K_FAULTS,
    BENCH_SHUFFLED64_NS, /* the 64 B batch freed in a fixed random order */
    BENCH_SHUFFLED64_ALLOC_NS,
    BENCH_SHUFFLED64_FREE_NS,
    BENCH_SHUFFLED64_FAULTS,
    BENCH_MIXED_NS, /* 1,000 allocs cycling through 8 sizes 16 B .. 1 KiB, freed in order */
    BENCH_MIXED_ALLOC_NS,
    BENCH_MIXED_FREE_NS,
    BENCH_MIXED_FAULTS,
    BENCH_LARGE_P50_NS, /* one 1..64 MiB allocation, memory never touched */
    BENCH_LARGE_P99_NS,
    BENCH_LARGE_P999_NS,
    BENCH_LARGE_MAX_NS,
    BENCH_LARGE_FAILURES,    /* kvalloc only: NOMEM answers caused by buddy fragmentation */
    BENCH_LARGE_FAULTS,      /* minor page faults per 1000 large allocations (measured part) */
    BENCH_LARGE_FAULT_COUNT, /* the same faults, all of them */
    BENCH_FRESH_P50_NS,      /* the first allocations of a new pool, 16 of 1..64 MiB live */
    BENCH_FRESH_P99_NS,
    BENCH_FRESH_P999_NS,
    BENCH_FRESH_MAX_NS,
    BENCH_FRESH_FAULTS,          /* minor page faults in those allocations and their frees */
    BENCH_FRESH_FAILURES,        /* kvalloc only: NOMEM answers caused by buddy fragmentation */
    BENCH_TOUCH_GBPS,            /* allocate 64 MiB blocks, store once per 4 KiB page, free */
    BENCH_TOUCH_PREFAULT_GBPS,   /* kvalloc only: the same on a pool created with prefault=1 */
    BENCH_TOUCH_FAULTS,          /* minor page faults in the timed pass (its first touches) */
    BENCH_TOUCH_PREFAULT_FAULTS, /* kvalloc only: the same on the prefault=1 pool */
    BENCH_CREATE_MS,             /* kvalloc only: kva_pool_create of the touch pattern's pool */
    BENCH_CREATE_PREFAULT_MS,
    BENCH_TIMER_NS,       /* cost of one clock read, included in every large-block sample */
    BENCH_METADATA_BYTES, /* kvalloc only, read at the largest live set of a pattern */
    BENCH_CAPACITY,
    BENCH_METADATA_FRACTION,
    BENCH_METADATA_FULL_FRACTION, /* kvalloc only: the same with the pool full of one size */
    BENCH_PAGE_KIND,              /* a kva_page_kind value */
    BENCH_PAGE_SIZE,
    BENCH_SYSCALL_CHECK_OPS, /* allocator calls made between the syscall-check markers */
    BENCH_METRIC_COUNT
};

static const char *const bench_metric_keys[BENCH_METRIC_COUNT] = {
    [BENCH_BATCH64_NS] = "batch64_ns_per_op",
    [BENCH_BATCH64_ALLOC_NS] = "batch64_ns_per_alloc",
    [BENCH_BATCH64_FREE_NS] = "batch64_ns_per_free",
    [BENCH_BATCH64_FAULTS] = "batch64_faults",
    [BENCH_BATCH4K_NS] = "batch4k_ns_per_op",
    [BENCH_BATCH4K_ALLOC_NS] = "batch4k_ns_per_alloc",
    [BENCH_BATCH4K_FREE_NS] = "batch4k_ns_per_free",
    [BENCH_BATCH4K_FAULTS] = "batch4k_faults",
    [BENCH_SHUFFLED64_NS] = "shuffled64_ns_per_op",
    [BENCH_SHUFFLED64_ALLOC_NS] = "shuffled64_ns_per_alloc",
    [BENCH_SHUFFLED64_FREE_NS] = "shuffled64_ns_per_free",
    [BENCH_SHUFFLED64_FAULTS] = "shuffled64_faults",
    [BENCH_MIXED_NS] = "mixed_ns_per_op",
    [BENCH_MIXED_ALLOC_NS] = "mixed_ns_per_alloc",
    [BENCH_MIXED_FREE_NS] = "mixed_ns_per_free",
    [BENCH_MIXED_FAULTS] = "mixed_faults",
    [BENCH_LARGE_P50_NS] = "large_alloc_p50_ns",
    [BENCH_LARGE_P99_NS] = "large_alloc_p99_ns",
    [BENCH_LARGE_P999_NS] = "large_alloc_p999_ns",
    [BENCH_LARGE_MAX_NS] = "large_alloc_max_ns",
    [BENCH_LARGE_FAILURES] = "large_alloc_failures",
    [BENCH_LARGE_FAULTS] = "large_alloc_faults_per_1000",
    [BENCH_LARGE_FAULT_COUNT] = "large_alloc_faults",
    [BENCH_FRESH_P50_NS] = "fresh_alloc_p50_ns",
    [BENCH_FRESH_P99_NS] = "fresh_alloc_p99_ns",
    [BENCH_FRESH_P999_NS] = "fresh_alloc_p999_ns",
    [BENCH_FRESH_MAX_NS] = "fresh_alloc_max_ns",
    [BENCH_FRESH_FAULTS] = "fresh_faults",
    [BENCH_FRESH_FAILURES] = "fresh_alloc_failures",
    [BENCH_TOUCH_GBPS] = "first_touch_gbps",
    [BENCH_TOUCH_PREFAULT_GBPS] = "first_touch_prefault_gbps",
    [BENCH_TOUCH_FAULTS] = "first_touch_faults",
    [BENCH_TOUCH_PREFAULT_FAULTS] = "first_touch_prefault_faults",
    [BENCH_CREATE_MS] = "pool_create_ms",
    [BENCH_CREATE_PREFAULT_MS] = "pool_create_prefault_ms",
    [BENCH_TIMER_NS] = "timer_overhead_ns",
    [BENCH_METADATA_BYTES] = "metadata_bytes",
    [BENCH_CAPACITY] = "capacity_bytes",
    [BENCH_METADATA_FRACTION] = "metadata_fraction",
    [BENCH_METADATA_FULL_FRACTION] = "metadata_fraction_full_pool",
    [BENCH_PAGE_KIND] = "page_kind",
    [BENCH_PAGE_SIZE] = "page_size",
    [BENCH_SYSCALL_CHECK_OPS] = "syscall_check_ops",
};

/* What the syscall check's child writes, with write(2), around the allocator calls it makes;
 * the parent counts the system calls strace saw between the two. */
#define BENCH_MARK_BEGIN "KVA_SYSCALL_CHECK_BEGIN"
#define BENCH_MARK_END "KVA_SYSCALL_CHECK_END"

/* Entry point of a child process (bench_child.c); argv[1] is "--child". Returns the exit
 * status. */
int bench_child_main(int argc, char **argv);

#endif
