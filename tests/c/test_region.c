/*
 * test_region.c — the backing memory: the huge-page fallback chain reports what it really got
 * (checked against the kernel's own view in /proc/self/smaps), prefault really takes the page
 * faults (checked with mincore), failures leave no mapping behind, and the base is aligned.
 * The region maps the capacity in whole pages of its kind, no 2 MiB tail (smaps, and mlock under
 * a small RLIMIT_MEMLOCK); metadata does not count against overcommit (a 4 TiB pool); a process
 * denied transparent huge pages is not told it has them.
 */
#include <errno.h>
#include <linux/capability.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "child.h"
#include "proc_self.h"
#include "kvalloc.h"
#include "pool.h"

/* Whether this process gets transparent huge pages where it advises them: the system allows
 * them (proc_self.h) and no one disabled them for it (PR_SET_THP_DISABLE, inherited across fork
 * and exec, as a container runtime may set; bit 1, except advised ranges, still allows them). */
static int process_gets_thp(void) {
    int disabled = prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0);
    return thp_available() && !(disabled > 0 && !(disabled & 2));
}

/* The bounds and Rss (bytes) of the mapping of /proc/self/smaps that contains addr. */
static int smaps_mapping(const void *addr, uintptr_t *lo, uintptr_t *hi, size_t *rss) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return 0;
    char line[512];
    int inside = 0, found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long a, b, kb;
        if (sscanf(line, "%lx-%lx ", &a, &b) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            inside = (uintptr_t)addr >= a && (uintptr_t)addr < b;
            *lo = a;
            *hi = b;
        } else if (inside && sscanf(line, "Rss: %lu kB", &kb) == 1) {
            *rss = (size_t)kb * 1024;
            found = 1;
        }
    }
    fclose(f);
    return found;
}

static kva_pool *create(kva_page_mode mode, size_t capacity, int prefault, kva_status expect) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.pages = mode;
    cfg.prefault = prefault;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), expect);
    return pool;
}

static void test_hugetlb(void) {
    size_t capacity = (size_t)8 << 20;
    long free_huge = meminfo_value("HugePages_Free");
    unsigned long maps_before = large_mapped_bytes(capacity);
    if (free_huge >= 4) {
        kva_pool *pool = create(KVA_PAGES_HUGETLB, capacity, 0, KVA_OK);
        kva_stats st;
        kva_get_stats(pool, &st);
        CHECK(st.page_kind == KVA_PAGE_KIND_HUGETLB && st.page_size == (size_t)2 << 20);
        kva_pool_destroy(pool);
    } else {
        /* No hugetlb pages reserved on this machine: forcing them is a backend error that says
         * why, and nothing stays mapped. */
        for (int i = 0; i < 20; i++) CHECK(create(KVA_PAGES_HUGETLB, capacity, 0, KVA_ERR_BACKEND) == NULL);
        CHECK(strstr(kva_last_error(), "MAP_HUGETLB") != NULL);
    }
    CHECK(!MAPS_ARE_RELIABLE || large_mapped_bytes(capacity) == maps_before);
}

static void test_auto_chain(void) {
    kva_pool *pool = create(KVA_PAGES_AUTO, (size_t)8 << 20, 0, KVA_OK);
    kva_stats st;
    kva_get_stats(pool, &st);
    kva_page_kind expected = meminfo_value("HugePages_Free") >= 4 ? KVA_PAGE_KIND_HUGETLB
                             : process_gets_thp()                 ? KVA_PAGE_KIND_THP
                                                                  : KVA_PAGE_KIND_SMALL;
    CHECK(st.page_kind == expected);
    kva_pool_destroy(pool);
}

static void test_thp_and_small(void) {
    void *base;
    char flags[512];
    if (process_gets_thp()) {
        kva_pool *pool = create(KVA_PAGES_THP, (size_t)8 << 20, 0, KVA_OK);
        kva_pool_base(pool, &base);
        REQUIRE(vm_flags_of(base, flags, sizeof flags));
        CHECK(strstr(flags, " hg") != NULL); /* the kernel recorded MADV_HUGEPAGE */
        kva_pool_destroy(pool);
    } else {
        CHECK(create(KVA_PAGES_THP, (size_t)8 << 20, 0, KVA_ERR_BACKEND) == NULL);
    }
    kva_pool *pool = create(KVA_PAGES_SMALL, (size_t)8 << 20, 0, KVA_OK);
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.page_kind == KVA_PAGE_KIND_SMALL && st.page_size == (size_t)sysconf(_SC_PAGESIZE));
    kva_pool_base(pool, &base);
    REQUIRE(vm_flags_of(base, flags, sizeof flags));
    CHECK(strstr(flags, " hg") == NULL);
    kva_pool_destroy(pool);
}

static void test_prefault(void) {
    size_t capacity = (size_t)16 << 20, pages = capacity / (size_t)sysconf(_SC_PAGESIZE);
    void *base;
    kva_pool *lazy = create(KVA_PAGES_SMALL, capacity, 0, KVA_OK);
    kva_pool_base(lazy, &base);
    CHECK(resident_pages(base, capacity) == 0);
    kva_pool_destroy(lazy);
    kva_pool *eager = create(KVA_PAGES_SMALL, capacity, 1, KVA_OK);
    kva_pool_base(eager, &base);
    CHECK(resident_pages(base, capacity) == pages);
    /* The metadata too: the first calls must not fault on block records or bitmaps. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t records = (eager->buddy.pages_bytes + page - 1) / page * page;
    size_t bitmaps = (eager->slabs.bitmaps_bytes + page - 1) / page * page;
    CHECK(resident_pages(eager->buddy.pages, records) == records / page);
    CHECK(resident_pages(eager->slabs.bitmaps, bitmaps) == bitmaps / page);
    kva_pool_destroy(eager);
}

/* The base is aligned to the largest block, so blocks are aligned to their size in absolute
 * addresses; a destroyed pool leaves no mapping behind. */
static void test_alignment_and_cleanup(void) {
    unsigned long maps_before = large_mapped_bytes((size_t)4 << 20);
    size_t capacities[] = {(size_t)4 << 20, (size_t)96 << 20, ((size_t)1 << 30) + 4096};
    for (size_t i = 0; i < 3; i++) {
        kva_pool *pool = create(KVA_PAGES_SMALL, capacities[i], 0, KVA_OK);
        void *base;
        kva_stats st;
        kva_pool_base(pool, &base);
        kva_get_stats(pool, &st);
        CHECK((uintptr_t)base % st.max_alloc_size == 0);
        kva_pool_destroy(pool);
        unsigned char probe;
        CHECK(mincore(base, 4096, &probe) != 0); /* nothing is mapped where the region was */
    }
    CHECK(!MAPS_ARE_RELIABLE || large_mapped_bytes((size_t)4 << 20) == maps_before);
}

/* A pool larger than the machine's memory: its pages are committed as they are touched, so a
 * pool sized for the worst case (a KV cache) must not be refused up front. */
static void test_pool_larger_than_memory(void) {
    size_t total = (size_t)meminfo_value("MemTotal") * 1024;
    size_t capacity = (size_t)1 << 30;
    while (capacity < 2 * total) capacity *= 2;
    kva_pool *pool = create(process_gets_thp() ? KVA_PAGES_THP : KVA_PAGES_SMALL, capacity, 0, KVA_OK);
    REQUIRE(pool);
    void *half;
    CHECK_STATUS(kva_alloc(pool, capacity / 2, &half), KVA_OK);
    CHECK_STATUS(kva_free(pool, half), KVA_OK);
    kva_pool_destroy(pool);
}

/* A pool that will be touched whole (prefault, lock, pin: registration page-locks every page) and
 * is larger than the memory and swap the
 * machine has: the kernel counts it at once and refuses it, and the pool is refused with
 * KVA_ERR_NOMEM, nothing left mapped. Left out of the accounting (MAP_NORESERVE, as a lazily
 * touched pool is), it was accepted and the touching ran until the OOM killer struck. Under
 * overcommit_memory=1 the kernel counts nothing, so this cannot be asked without risking that. */
static void test_touched_pool_larger_than_memory(void) {
    FILE *f = fopen("/proc/sys/vm/overcommit_memory", "r");
    int mode = -1;
    if (f) {
        if (fscanf(f, "%d", &mode) != 1) mode = -1;
        fclose(f);
    }
    if (mode != 0 && mode != 2) {
        fprintf(stderr,
                "test_touched_pool_larger_than_memory: skipped, overcommit_memory is %d: the kernel "
                "would accept the mapping and the prefault would meet the OOM killer\n",
                mode);
        return;
    }
    size_t memory = (size_t)(meminfo_value("MemTotal") + meminfo_value("SwapTotal")) * 1024;
    size_t capacity = (size_t)1 << 30;
    while (capacity < 2 * memory) capacity *= 2;
    long maps_before = mapping_count();
    for (int way = 0; way < 3; way++) {
        kva_config cfg;
        kva_config_init(&cfg);
        cfg.capacity = capacity;
        cfg.prefault = way == 0;
        cfg.lock = way == 1;
        cfg.pin = way == 2; /* refused before the CUDA driver is looked for */
        kva_pool *pool = NULL;
        CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_NOMEM);
        CHECK(pool == NULL);
        if (!strstr(kva_last_error(), "to be touched")) {
            fprintf(stderr, "way %d: %s\n", way, kva_last_error());
            check_failures++;
        }
    }
    CHECK(!MAPS_ARE_RELIABLE || mapping_count() == maps_before);
}

/* The metadata is committed as it is touched, like the region: a pool far larger than memory
 * (4 TiB here, whose slab bitmaps alone are some 80 GiB) is not refused up front by the
 * overcommit heuristic. Under overcommit_memory=2 nothing is committed lazily, and the refusal
 * of the metadata says there is no memory for it. */
static void test_metadata_larger_than_memory(void) {
    size_t capacity = (size_t)4 << 40;
    struct rlimit as;
    if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY && as.rlim_cur < 2 * capacity) {
        fprintf(stderr, "test_metadata_larger_than_memory: skipped, RLIMIT_AS (%llu bytes) is below 8 TiB\n",
                (unsigned long long)as.rlim_cur);
        return;
    }
    FILE *f = fopen("/proc/sys/vm/overcommit_memory", "r");
    int policy = -1;
    if (f) {
        if (fscanf(f, "%d", &policy) != 1) policy = -1;
        fclose(f);
    }
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.min_block = 4096;
    cfg.pages = KVA_PAGES_SMALL;
    kva_pool *pool = NULL;
    kva_status st = kva_pool_create(&cfg, &pool);
    if (policy == 2) {
        fprintf(stderr,
                "test_metadata_larger_than_memory: overcommit_memory is 2 (strict), so a 4 TiB pool "
                "must be refused: %s\n",
                kva_last_error());
        CHECK(st != KVA_OK);
        if (strstr(kva_last_error(), "metadata")) CHECK_STATUS(st, KVA_ERR_NOMEM);
        if (st == KVA_OK) kva_pool_destroy(pool);
        return;
    }
    CHECK_STATUS(st, KVA_OK);
    if (st != KVA_OK) return;
    void *small, *large;
    CHECK_STATUS(kva_alloc(pool, 1000, &small), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, capacity / 2, &large), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_free(pool, small), KVA_OK);
    CHECK_STATUS(kva_free(pool, large), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* A region maps whole pages of its kind past the capacity, and no more: 4 KiB pages for base
 * and transparent huge pages (a huge page in the tail would be memory no block uses), so
 * prefault faults in the capacity, not a 2 MiB tail. Checked in the kernel's view: the mapping
 * in /proc/self/smaps spans exactly the capacity and all of it is resident. */
static void expect_prefault_maps_capacity(kva_page_mode mode, size_t capacity) {
    kva_pool *pool = create(mode, capacity, 1, KVA_OK);
    REQUIRE(pool);
    void *base;
    kva_pool_base(pool, &base);
    uintptr_t lo = 0, hi = 0;
    size_t rss = 0;
    REQUIRE(smaps_mapping(base, &lo, &hi, &rss));
    CHECK(lo == (uintptr_t)base && hi - lo == capacity);
    CHECK(rss == capacity);
    if (hi - lo != capacity || rss != capacity)
        fprintf(stderr, "pages %d, capacity %zu: mapping of %zu bytes, %zu resident\n", (int)mode, capacity,
                (size_t)(hi - lo), rss);
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.mapped_bytes == capacity);
    kva_pool_destroy(pool);
}

static void test_prefault_maps_only_capacity(void) {
    expect_prefault_maps_capacity(KVA_PAGES_SMALL, (size_t)64 << 10);
    if (process_gets_thp()) expect_prefault_maps_capacity(KVA_PAGES_THP, ((size_t)2 << 20) + ((size_t)64 << 10));
}

/* Drops CAP_IPC_LOCK from the effective set (root ignores RLIMIT_MEMLOCK with it), where the
 * process has it at all. 0 on success. */
static int drop_ipc_lock(void) {
    struct __user_cap_header_struct header = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &header, data) != 0) return -1;
    data[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
    return syscall(SYS_capset, &header, data) == 0 ? 0 : -1;
}

/* In a child: under an RLIMIT_MEMLOCK of 3 MiB, a locked pool of 2 MiB + 4 KiB fits, since
 * mlock covers the capacity in whole base pages, not whole 2 MiB ones. */
static int lock_fits_the_limit(void) {
    size_t limit = (size_t)3 << 20, capacity = ((size_t)2 << 20) + 4096;
    if (drop_ipc_lock() != 0) {
        fprintf(stderr, "test_lock_fits_the_limit: skipped, cannot drop CAP_IPC_LOCK: %s\n", strerror(errno));
        return 77;
    }
    struct rlimit rl = {.rlim_cur = limit, .rlim_max = limit};
    if (setrlimit(RLIMIT_MEMLOCK, &rl) != 0) {
        fprintf(stderr, "test_lock_fits_the_limit: skipped, cannot lower RLIMIT_MEMLOCK: %s\n", strerror(errno));
        return 77;
    }
    /* The limit must bind, or the test proves nothing: 4 MiB cannot be locked. */
    size_t probe_len = (size_t)4 << 20;
    void *probe = mmap(NULL, probe_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(probe != MAP_FAILED);
    int binds = mlock(probe, probe_len) != 0;
    munmap(probe, probe_len);
    if (!binds) {
        fprintf(stderr, "test_lock_fits_the_limit: skipped, 4 MiB were locked under a 3 MiB RLIMIT_MEMLOCK%s\n",
                MAPS_ARE_RELIABLE ? "" : " (AddressSanitizer makes mlock a no-op)");
        return 77;
    }
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.lock = 1;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    if (pool) {
        kva_stats st;
        kva_get_stats(pool, &st);
        CHECK(st.locked && st.mapped_bytes == capacity);
        kva_pool_destroy(pool);
    }
    return check_failures ? 1 : 0;
}

/* In a child whose transparent huge pages are disabled (PR_SET_THP_DISABLE): madvise still
 * accepts the advice, but the pool must not claim THP. Auto mode falls through to base pages
 * (and reports their size, which the KV trim and prefault then work in); THP asked for is
 * refused, as hugetlb is where there is none. */
static int thp_disabled_child(void) {
    if (prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0) {
        fprintf(stderr, "test_thp_disabled: skipped, prctl(PR_SET_THP_DISABLE): %s\n", strerror(errno));
        return 77;
    }
    if (meminfo_value("HugePages_Free") >= 4)
        fprintf(stderr, "test_thp_disabled: hugetlb pages are reserved here, so auto mode takes them; "
                        "only the explicit THP request is checked\n");
    else {
        kva_pool *pool = create(KVA_PAGES_AUTO, (size_t)8 << 20, 0, KVA_OK);
        REQUIRE(pool);
        kva_stats st;
        kva_get_stats(pool, &st);
        CHECK(st.page_kind == KVA_PAGE_KIND_SMALL && st.page_size == (size_t)sysconf(_SC_PAGESIZE));
        kva_pool_destroy(pool);
    }
    CHECK(create(KVA_PAGES_THP, (size_t)8 << 20, 0, KVA_ERR_BACKEND) == NULL);
    CHECK(strstr(kva_last_error(), "PR_SET_THP_DISABLE") != NULL);
    /* The pools a KV cache and a variable-size pool make for themselves prefer THP by default;
     * here they take base pages rather than refuse: their callers asked for a cache and a
     * pool, not for THP. */
    kva_kv_config kc;
    kva_kv_config_init(&kc);
    kc.layers = 2;
    kc.kv_heads = 2;
    kc.head_dim = 64;
    kc.num_blocks = 64;
    kva_kv *kv = NULL;
    CHECK_STATUS(kva_kv_create(&kc, NULL, &kv), KVA_OK);
    if (kv) {
        kva_kv_seq seq;
        CHECK_STATUS(kva_kv_seq_allocate(kv, 100, NULL, 0, NULL, 0, 0, 0, &seq, NULL), KVA_OK);
        CHECK_STATUS(kva_kv_check(kv), KVA_OK);
        kva_kv_destroy(kv);
    }
    kva_var_config vc;
    kva_var_config_init(&vc);
    kva_var *var = NULL;
    CHECK_STATUS(kva_var_create(&vc, NULL, &var), KVA_OK);
    void *p;
    if (var) {
        CHECK_STATUS(kva_var_alloc(var, 4096, &p), KVA_OK);
        CHECK_STATUS(kva_var_free(var, p), KVA_OK);
        kva_var_destroy(var);
    }
    return check_failures ? 1 : 0;
}

/* A pool whose region the kernel will not reserve (128 TiB, more than user space) is refused
 * before its metadata is written. With 8 MiB blocks it has 2^24 slab chunks, whose descriptors
 * (64 bytes each, every one written at creation) are a gigabyte, which a creation that wrote
 * them before reserving the region would write only to refuse. In a child, whose peak
 * resident size starts at what the fork gave it. */
static int refused_region_writes_no_metadata(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)1 << 47;
    cfg.min_block = (size_t)8 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.arenas = 1;
    struct rusage before, after;
    getrusage(RUSAGE_SELF, &before);
    kva_pool *pool = NULL;
    kva_status st = kva_pool_create(&cfg, &pool);
    getrusage(RUSAGE_SELF, &after);
    if (st == KVA_OK) {
        printf("test_region: skipped the refused region: this kernel reserved 128 TiB\n");
        kva_pool_destroy(pool);
        return 77;
    }
    CHECK(st == KVA_ERR_BACKEND || st == KVA_ERR_NOMEM);
    CHECK(pool == NULL);
    long grown_mib = (after.ru_maxrss - before.ru_maxrss) / 1024;
    if (grown_mib > 64) fprintf(stderr, "test_region: the refused pool's creation touched %ld MiB\n", grown_mib);
    CHECK(grown_mib <= 64);
    return check_failures ? 1 : 0;
}

int main(void) {
    in_child(refused_region_writes_no_metadata, "test_refused_region_writes_no_metadata");
    test_hugetlb();
    test_auto_chain();
    test_thp_and_small();
    test_prefault();
    test_alignment_and_cleanup();
    test_pool_larger_than_memory();
    test_metadata_larger_than_memory();
    test_touched_pool_larger_than_memory();
    test_prefault_maps_only_capacity();
    in_child(lock_fits_the_limit, "test_lock_fits_the_limit");
    in_child(thp_disabled_child, "test_thp_disabled");
    return CHECK_DONE();
}
