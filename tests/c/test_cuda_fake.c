/*
 * test_cuda_fake.c — the CUDA backend against the fake driver of tests/fake_cuda (its path is
 * argv[1]): what is mapped and when, trimming, the watermark, prefault, pinned host pools, and
 * every failure the driver can return — no driver, no GPU, out of memory, each call refused —
 * with the pool unchanged afterwards and nothing left reserved, mapped, created or retained.
 *
 * The fake reserves device addresses PROT_NONE, so a library that touched pool memory would
 * crash this test.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "proc_self.h"
#include "cuda_driver.h"
#include "kvalloc.h"

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)

static struct {
    void (*reset)(void);
    void (*set_devices)(int);
    void (*set_memory)(size_t);
    void (*set_granularity)(size_t);
    void (*set_vmm)(int);
    void (*fail)(const char *, unsigned long, int);
    void (*disarm)(void);
    unsigned long (*calls)(const char *);
    size_t (*used_bytes)(void);
    size_t (*live_handles)(void);
    size_t (*mappings)(void);
    size_t (*reservations)(void);
    size_t (*registrations)(void);
    unsigned (*retains)(int);
    int (*context_depth)(void);
    const char *(*last_fired)(void);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*primary_release)(CUdevice);
    CUresult (*push)(CUcontext);
    CUresult (*pop)(CUcontext *);
} fake;

static size_t granule = 2 * MiB;

static void *symbol(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "the fake driver lacks %s\n", name);
        exit(1);
    }
    return p;
}

static void load_fake(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "cannot load the fake driver %s: %s\n", path, dlerror());
        exit(1);
    }
#define GET(field, name) *(void **)&fake.field = symbol(lib, name)
    GET(reset, "fake_cuda_reset");
    GET(set_devices, "fake_cuda_set_devices");
    GET(set_memory, "fake_cuda_set_memory");
    GET(set_granularity, "fake_cuda_set_granularity");
    GET(set_vmm, "fake_cuda_set_vmm");
    GET(fail, "fake_cuda_fail");
    GET(disarm, "fake_cuda_disarm");
    GET(calls, "fake_cuda_calls");
    GET(used_bytes, "fake_cuda_used_bytes");
    GET(live_handles, "fake_cuda_live_handles");
    GET(mappings, "fake_cuda_mappings");
    GET(reservations, "fake_cuda_reservations");
    GET(registrations, "fake_cuda_registrations");
    GET(retains, "fake_cuda_retains");
    GET(context_depth, "fake_cuda_context_depth");
    GET(last_fired, "fake_cuda_last_fired");
    GET(primary_retain, "cuDevicePrimaryCtxRetain");
    GET(primary_release, "cuDevicePrimaryCtxRelease_v2");
    GET(push, "cuCtxPushCurrent_v2");
    GET(pop, "cuCtxPopCurrent_v2");
#undef GET
}


/* Nothing of the driver is held: the state after every pool is gone. */
#define CHECK_NO_LEAKS()                  \
    do {                                  \
        CHECK(fake.reservations() == 0);  \
        CHECK(fake.mappings() == 0);      \
        CHECK(fake.live_handles() == 0);  \
        CHECK(fake.used_bytes() == 0);    \
        CHECK(fake.registrations() == 0); \
        CHECK(fake.retains(0) == 0);      \
        CHECK(fake.context_depth() == 0); \
    } while (0)

#define CHECK_ERROR_SAYS(words)                                                                                 \
    do {                                                                                                        \
        if (!strstr(kva_last_error(), words)) {                                                                 \
            fprintf(stderr, "%s:%d: expected \"%s\" in \"%s\"\n", __FILE__, __LINE__, words, kva_last_error()); \
            check_failures++;                                                                                   \
        }                                                                                                       \
    } while (0)

static kva_config cuda_config(size_t capacity) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.backend = KVA_BACKEND_CUDA;
    return cfg;
}

static kva_pool *cuda_pool(size_t capacity, int prefault, size_t watermark) {
    kva_config cfg = cuda_config(capacity);
    cfg.prefault = prefault;
    cfg.trim_watermark = watermark;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool != NULL);
    return pool;
}

static kva_stats stats_of(kva_pool *pool) {
    kva_stats st;
    REQUIRE(kva_get_stats(pool, &st) == KVA_OK);
    return st;
}

/* The pool's mapped bytes agree with the driver's mappings, one handle per granule. */
static void check_agrees(kva_pool *pool) {
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_stats st = stats_of(pool);
    CHECK(st.mapped_bytes == fake.mappings() * granule);
    CHECK(fake.live_handles() == fake.mappings());
}

/* ---- the driver or the GPU missing ---------------------------------------------------------- */

static void test_no_driver(void) {
    setenv("KVA_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
    kva_config cfg = cuda_config(64 * MiB);
    kva_pool *pool = NULL;
    /* A first failure allocates what dlopen's error reporting needs; count mappings after it. */
    kva_pool_create(&cfg, &pool);
    long before = mapping_count();
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_BACKEND);
    CHECK(pool == NULL);
    CHECK_ERROR_SAYS("no CUDA driver");
    CHECK_ERROR_SAYS("/nonexistent/libcuda.so.1");
    kva_config host;
    kva_config_init(&host);
    host.capacity = 4 * MiB;
    host.pin = 1;
    CHECK_STATUS(kva_pool_create(&host, &pool), KVA_ERR_BACKEND);
    CHECK_ERROR_SAYS("pin");
    CHECK_ERROR_SAYS("no CUDA driver");
    CHECK(!MAPS_ARE_RELIABLE || mapping_count() == before); /* see proc_self.h */
}

static void test_no_gpu(const char *fake_path) {
    setenv("KVA_CUDA_DRIVER", fake_path, 1);
    kva_config cfg = cuda_config(64 * MiB);
    kva_pool *pool = NULL;
    /* No GPU at all: the driver's cuInit says so, before anything is loaded for good. */
    fake.set_devices(0);
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_BACKEND);
    CHECK_ERROR_SAYS("no CUDA GPU");
    CHECK_ERROR_SAYS("CUDA_ERROR_NO_DEVICE");
    fake.set_devices(1);
    pool = cuda_pool(64 * MiB, 0, 0);
    kva_pool_destroy(pool);
    /* A loaded driver that later counts no device. */
    fake.set_devices(0);
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_BACKEND);
    CHECK_ERROR_SAYS("no CUDA GPU");
    CHECK_ERROR_SAYS("0 devices");
    fake.set_devices(1);
    cfg.device = 3;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_INVALID);
    CHECK_ERROR_SAYS("CUDA device 3 does not exist");
    cfg.device = 0;
    fake.set_vmm(0);
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_BACKEND);
    CHECK_ERROR_SAYS("virtual memory management");
    fake.set_vmm(1);
    CHECK_NO_LEAKS();
}

static void test_config(void) {
    kva_pool *pool = NULL;
    static const char *words[] = {"numa_node", "lock", "pin", "pages"};
    for (int i = 0; i < 4; i++) {
        kva_config cfg = cuda_config(64 * MiB);
        if (i == 0) cfg.numa_node = 0;
        if (i == 1) cfg.lock = 1;
        if (i == 2) cfg.pin = 1;
        if (i == 3) cfg.pages = KVA_PAGES_HUGETLB;
        CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_INVALID);
        CHECK_ERROR_SAYS(words[i]);
    }
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.trim_watermark = MiB;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_INVALID);
    CHECK_ERROR_SAYS("trim_watermark");
    cfg = cuda_config(64 * MiB);
    cfg.device = -1;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_INVALID);
    cfg = cuda_config(64 * MiB);
    cfg.backend = (kva_backend)7;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_INVALID);
    CHECK_ERROR_SAYS("unknown backend");
    CHECK_NO_LEAKS();
}

/* ---- mapping on demand, trimming ------------------------------------------------------------- */

static void test_on_demand(void) {
    kva_pool *pool = cuda_pool(64 * MiB, 0, 0);
    kva_stats st = stats_of(pool);
    CHECK(st.backend == KVA_BACKEND_CUDA && st.page_kind == KVA_PAGE_KIND_DEVICE && st.page_size == granule);
    CHECK(st.mapped_bytes == 0 && st.numa_node == -1 && st.pinned == 0 && st.locked == 0);
    CHECK(fake.reservations() == 1 && fake.mappings() == 0 && fake.retains(0) == 1);
    void *base;
    kva_pool_base(pool, &base);
    CHECK((uintptr_t)base % st.max_alloc_size == 0);

    void *a, *b, *big;
    unsigned long creates = fake.calls("cuMemCreate");
    CHECK_STATUS(kva_alloc(pool, 64, &a), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == granule); /* the slab's chunk */
    CHECK_STATUS(kva_alloc(pool, 64, &b), KVA_OK);
    CHECK(fake.calls("cuMemCreate") == creates + 1); /* the second object maps nothing */
    CHECK_STATUS(kva_alloc(pool, 8 * MiB, &big), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == granule + 8 * MiB);
    check_agrees(pool);
    CHECK(kva_usable_size(pool, big) == 8 * MiB);

    CHECK_STATUS(kva_free(pool, big), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == granule + 8 * MiB); /* idle until trimmed */
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == granule); /* the slab still has live objects */
    check_agrees(pool);
    CHECK_STATUS(kva_free(pool, a), KVA_OK);
    CHECK_STATUS(kva_free(pool, b), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == granule); /* the empty slab is its class's spare */
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == 0);
    CHECK(fake.mappings() == 0 && fake.live_handles() == 0 && fake.used_bytes() == 0);
    check_agrees(pool);
    kva_pool_destroy(pool);
    CHECK_NO_LEAKS();
}

/* Blocks smaller than a granule share it; it goes only when the last of them is freed. */
static void test_shared_granule(void) {
    kva_pool *pool = cuda_pool(64 * MiB, 0, 0);
    void *base, *a, *b, *c;
    kva_pool_base(pool, &base);
    CHECK_STATUS(kva_alloc_exact(pool, 100 * KiB, &a), KVA_OK);
    CHECK_STATUS(kva_alloc_exact(pool, 100 * KiB, &b), KVA_OK);
    CHECK_STATUS(kva_alloc_aligned(pool, 4 * KiB, MiB, &c), KVA_OK);
    CHECK((uintptr_t)c % MiB == 0);
    uintptr_t ga = ((uintptr_t)a - (uintptr_t)base) / granule, gb = ((uintptr_t)b - (uintptr_t)base) / granule;
    CHECK(ga == gb);
    check_agrees(pool);
    size_t mapped = stats_of(pool).mapped_bytes;
    CHECK_STATUS(kva_free(pool, a), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == mapped); /* b still uses the granule */
    CHECK_STATUS(kva_free(pool, b), KVA_OK);
    CHECK_STATUS(kva_free(pool, c), KVA_OK);
    check_agrees(pool);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == 0);
    kva_pool_destroy(pool);
    CHECK_NO_LEAKS();
}

static void test_watermark(void) {
    kva_pool *pool = cuda_pool(64 * MiB, 0, 4 * MiB);
    void *blocks[8];
    for (int i = 0; i < 8; i++) CHECK_STATUS(kva_alloc(pool, 2 * MiB, &blocks[i]), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == 16 * MiB);
    for (int i = 0; i < 8; i++) {
        CHECK_STATUS(kva_free(pool, blocks[i]), KVA_OK);
        size_t idle = (size_t)(i + 1) * 2 * MiB;
        CHECK(stats_of(pool).mapped_bytes == 16 * MiB - (idle > 4 * MiB ? idle - 4 * MiB : 0));
        check_agrees(pool);
    }
    /* The two granules freed last are the ones kept: allocating them again maps nothing. */
    unsigned long creates = fake.calls("cuMemCreate");
    void *again;
    CHECK_STATUS(kva_alloc(pool, 2 * MiB, &again), KVA_OK);
    if (again == blocks[7] || again == blocks[6]) CHECK(fake.calls("cuMemCreate") == creates);
    CHECK_STATUS(kva_free(pool, again), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == 0);
    kva_pool_destroy(pool);
    CHECK_NO_LEAKS();
}

static void test_prefault(void) {
    kva_pool *pool = cuda_pool(16 * MiB, 1, 0);
    CHECK(stats_of(pool).mapped_bytes == 16 * MiB && fake.mappings() == 8);
    unsigned long creates = fake.calls("cuMemCreate");
    void *p, *q;
    CHECK_STATUS(kva_alloc(pool, 4 * MiB, &p), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 100, &q), KVA_OK);
    CHECK(fake.calls("cuMemCreate") == creates);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    CHECK_STATUS(kva_free(pool, q), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == 16 * MiB); /* resident for the pool's life */
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
    CHECK_NO_LEAKS();
    /* Too little GPU memory to prefault: out of memory, and nothing kept. */
    fake.set_memory(8 * MiB);
    kva_config cfg = cuda_config(16 * MiB);
    cfg.prefault = 1;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_NOMEM);
    CHECK_ERROR_SAYS("CUDA_ERROR_OUT_OF_MEMORY");
    fake.set_memory(1ull << 30);
    CHECK_NO_LEAKS();
}

/* ---- failures while the pool is in use --------------------------------------------------------- */

static void test_out_of_memory(void) {
    fake.set_memory(8 * MiB);
    kva_pool *pool = cuda_pool(64 * MiB, 0, 0);
    void *p1, *p2, *p3;
    CHECK_STATUS(kva_alloc(pool, 4 * MiB, &p1), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 4 * MiB, &p2), KVA_OK);
    kva_stats before = stats_of(pool);
    CHECK_STATUS(kva_alloc(pool, 4 * MiB, &p3), KVA_ERR_NOMEM);
    CHECK_ERROR_SAYS("cuMemCreate");
    CHECK_ERROR_SAYS("CUDA_ERROR_OUT_OF_MEMORY");
    kva_stats after = stats_of(pool);
    CHECK(after.bytes_free == before.bytes_free && after.live_allocations == before.live_allocations);
    CHECK(after.mapped_bytes == before.mapped_bytes && after.alloc_failures == before.alloc_failures + 1);
    CHECK_STATUS(kva_alloc_exact(pool, 3 * MiB, &p3), KVA_ERR_NOMEM);
    CHECK_STATUS(kva_alloc(pool, 64, &p3), KVA_ERR_NOMEM); /* no memory for a slab either */
    check_agrees(pool);
    /* Freed memory stays mapped, idle; a request that needs new memory takes it back first. */
    CHECK_STATUS(kva_free(pool, p1), KVA_OK);
    void *p4;
    CHECK_STATUS(kva_alloc(pool, 2 * MiB, &p3), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, 64, &p4), KVA_OK);
    check_agrees(pool);
    CHECK_STATUS(kva_free(pool, p2), KVA_OK);
    CHECK_STATUS(kva_free(pool, p3), KVA_OK);
    CHECK_STATUS(kva_free(pool, p4), KVA_OK);
    kva_pool_destroy(pool);
    fake.set_memory(1ull << 30);
    CHECK_NO_LEAKS();
}

/* Each driver call of the mapping path refused once: the allocation fails with a status that
 * names the call, and the pool and the driver are left exactly as they were. */
static void test_commit_failures(void) {
    static const struct {
        const char *function;
        int code;
        kva_status expect;
        const char *words;
    } cases[] = {
        {"cuMemCreate", CUDA_ERROR_OUT_OF_MEMORY, KVA_ERR_NOMEM, "cuMemCreate"},
        {"cuMemCreate", CUDA_ERROR_UNKNOWN, KVA_ERR_BACKEND, "CUDA_ERROR_UNKNOWN"},
        {"cuMemMap", CUDA_ERROR_INVALID_VALUE, KVA_ERR_BACKEND, "cuMemMap"},
        {"cuMemSetAccess", CUDA_ERROR_INVALID_VALUE, KVA_ERR_BACKEND, "cuMemSetAccess"},
        {"cuCtxPushCurrent_v2", CUDA_ERROR_INVALID_CONTEXT, KVA_ERR_BACKEND, "cuCtxPushCurrent"},
    };
    kva_pool *pool = cuda_pool(64 * MiB, 0, 0);
    void *keep, *p;
    CHECK_STATUS(kva_alloc(pool, 8 * MiB, &keep), KVA_OK);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (unsigned long nth = 1; nth <= 3; nth++) {
            /* nth > 1: the failure strikes in the middle of an 8 MiB block's four granules. */
            if (nth > 1 && strcmp(cases[i].function, "cuCtxPushCurrent_v2") == 0) continue;
            kva_stats before = stats_of(pool);
            size_t handles = fake.live_handles(), mappings = fake.mappings();
            fake.fail(cases[i].function, nth, cases[i].code);
            CHECK_STATUS(kva_alloc(pool, 8 * MiB, &p), cases[i].expect);
            CHECK_ERROR_SAYS(cases[i].words);
            fake.disarm();
            kva_stats after = stats_of(pool);
            CHECK(after.bytes_free == before.bytes_free && after.live_allocations == before.live_allocations);
            CHECK(after.mapped_bytes == before.mapped_bytes);
            CHECK(fake.live_handles() == handles && fake.mappings() == mappings);
            CHECK(fake.context_depth() == 0);
            check_agrees(pool);
        }
    }
    /* A failure in a range that holds idle granules: they stay idle, only this call's
     * mappings are undone. */
    CHECK_STATUS(kva_free(pool, keep), KVA_OK);
    size_t mapped = stats_of(pool).mapped_bytes;
    CHECK(mapped == 8 * MiB);
    fake.fail("cuMemCreate", 2, CUDA_ERROR_OUT_OF_MEMORY);
    kva_status st = kva_alloc(pool, 32 * MiB, &p);
    fake.disarm();
    CHECK(st == KVA_ERR_NOMEM || st == KVA_OK);
    if (st == KVA_OK) CHECK_STATUS(kva_free(pool, p), KVA_OK);
    check_agrees(pool);
    kva_pool_destroy(pool);
    CHECK_NO_LEAKS();
}

/* Every driver call that creation makes is refused in turn: creation fails cleanly each time. */
static void test_creation_sweep(void) {
    int codes[] = {CUDA_ERROR_UNKNOWN, CUDA_ERROR_OUT_OF_MEMORY};
    for (int prefault = 0; prefault < 2; prefault++) {
        for (int c = 0; c < 2; c++) {
            unsigned long n;
            for (n = 1; n < 200; n++) {
                kva_config cfg = cuda_config(8 * MiB);
                cfg.prefault = prefault;
                kva_pool *pool = NULL;
                unsigned long calls = fake.calls("*");
                fake.fail("*", n, codes[c]);
                kva_status st = kva_pool_create(&cfg, &pool);
                int fired = fake.calls("*") - calls >= n;
                fake.disarm();
                if (st == KVA_OK) {
                    check_agrees(pool);
                    kva_pool_destroy(pool);
                } else {
                    CHECK(pool == NULL && kva_last_error()[0] != '\0');
                    CHECK(st == KVA_ERR_BACKEND || st == KVA_ERR_NOMEM);
                }
                CHECK(fake.reservations() == 0 && fake.mappings() == 0 && fake.live_handles() == 0);
                CHECK(fake.retains(0) == 0);
                if (fake.context_depth() != 0) {
                    /* Only a refused pop leaves the library's context current: nothing can undo it. */
                    CHECK(strcmp(fake.last_fired(), "cuCtxPopCurrent_v2") == 0);
                    while (fake.context_depth() > 0) fake.pop(NULL);
                }
                if (!fired) break;
            }
            CHECK(n > 5 && n < 200);
        }
    }
    CHECK_NO_LEAKS();
}

/* A long random workload on a fine granularity with the mapping calls failing now and then:
 * after every call the pool's invariants hold (kva_check walks the granule references) and
 * its figures agree with the driver's. */
static void test_random_with_faults(void) {
    static const char *targets[] = {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuCtxPushCurrent_v2", "cuMemUnmap"};
    granule = 64 * KiB;
    fake.set_granularity(granule);
    kva_config cfg = cuda_config(32 * MiB);
    cfg.slab_chunk = 64 * KiB;
    cfg.trim_watermark = 512 * KiB;
    /* One arena: which driver call an armed failure hits depends on where slabs grow, and with
     * one arena per CPU that would follow the CPU the scheduler picks; with one, the run is the
     * same every time (srand below). */
    cfg.arenas = 1;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    enum {
        SLOTS = 256
    };
    void *live[SLOTS] = {0};
    unsigned failures = 0;
    int failed_before = check_failures;
    srand(12345);
    for (int step = 0; step < 4000 && check_failures == failed_before; step++) {
        if (rand() % 20 == 0) {
            fake.fail(targets[rand() % 5], 1 + (unsigned long)(rand() % 3),
                      rand() % 2 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN);
        }
        int slot = rand() % SLOTS;
        kva_status st = KVA_OK;
        if (live[slot]) {
            st = kva_free(pool, live[slot]);
            CHECK_STATUS(st, KVA_OK);
            live[slot] = NULL;
        } else {
            int kind = rand() % 10;
            size_t size = kind < 6   ? 1 + (size_t)(rand() % 4096)
                          : kind < 9 ? 64 * KiB + (size_t)(rand() % (int)MiB)
                                     : 3 * MiB;
            st = kind == 8   ? kva_alloc_exact(pool, size, &live[slot])
                 : kind == 7 ? kva_alloc_aligned(pool, size, 128 * KiB, &live[slot])
                             : kva_alloc(pool, size, &live[slot]);
            if (st != KVA_OK) {
                CHECK(st == KVA_ERR_NOMEM || st == KVA_ERR_BACKEND);
                live[slot] = NULL;
                failures++;
            }
        }
        if (step % 97 == 0) {
            st = kva_trim(pool);
            CHECK(st == KVA_OK || st == KVA_ERR_BACKEND);
        }
        fake.disarm();
        CHECK(fake.context_depth() == 0);
        CHECK_STATUS(kva_check(pool), KVA_OK);
        CHECK(stats_of(pool).mapped_bytes == fake.mappings() * granule);
    }
    CHECK(failures > 0);
    for (int i = 0; i < SLOTS; i++)
        if (live[i]) CHECK_STATUS(kva_free(pool, live[i]), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    CHECK(stats_of(pool).mapped_bytes == 0);
    check_agrees(pool);
    kva_pool_destroy(pool);
    CHECK_NO_LEAKS();
    granule = 2 * MiB;
    fake.set_granularity(granule);
}

/* ---- host pools registered with the driver; the caller's context ------------------------------ */

static void test_pin(void) {
    long before = mapping_count();
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = 4 * MiB;
    cfg.pin = 1;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    kva_stats st = stats_of(pool);
    CHECK(st.pinned == 1 && st.backend == KVA_BACKEND_HOST);
    CHECK(fake.registrations() == 1 && fake.retains(0) == 1);
    void *p;
    CHECK_STATUS(kva_alloc(pool, 1000, &p), KVA_OK);
    memset(p, 1, 1000); /* host memory: the CPU may touch it */
    kva_pool_destroy(pool);
    CHECK_NO_LEAKS();
    fake.fail("cuMemHostRegister_v2", 1, CUDA_ERROR_NOT_SUPPORTED);
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_BACKEND);
    CHECK_ERROR_SAYS("pin");
    CHECK_ERROR_SAYS("cuMemHostRegister");
    cfg.device = 5;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_INVALID);
    CHECK_ERROR_SAYS("CUDA device 5 does not exist");
    CHECK(!MAPS_ARE_RELIABLE || mapping_count() == before); /* see proc_self.h */
    CHECK_NO_LEAKS();
}

/* The library makes its context current only around its own calls: the caller's stays. */
static void test_callers_context(void) {
    CUcontext mine = NULL, top = NULL;
    REQUIRE(fake.primary_retain(&mine, 0) == CUDA_SUCCESS && fake.push(mine) == CUDA_SUCCESS);
    kva_pool *pool = cuda_pool(64 * MiB, 0, 0), *other = cuda_pool(32 * MiB, 0, 0);
    CHECK(fake.retains(0) == 3 && fake.context_depth() == 1);
    void *p;
    CHECK_STATUS(kva_alloc(pool, 16 * MiB, &p), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK);
    kva_pool_destroy(pool);
    kva_pool_destroy(other);
    CHECK(fake.context_depth() == 1);
    CHECK(fake.pop(&top) == CUDA_SUCCESS && top == mine);
    CHECK(fake.primary_release(0) == CUDA_SUCCESS);
    CHECK_NO_LEAKS();
}

/* Walk, usable size and the statistics segment read host metadata only. */
static int count_regions(uint64_t offset, uint64_t size, kva_walk_kind kind, void *ctx) {
    (void)offset, (void)size, (void)kind;
    ++*(int *)ctx;
    return 0;
}

static void test_introspection(void) {
    kva_config cfg = cuda_config(64 * MiB);
    cfg.name = "cuda-fake-test";
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    void *a, *b;
    CHECK_STATUS(kva_alloc(pool, 300, &a), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, MiB, &b), KVA_OK);
    int regions = 0;
    CHECK_STATUS(kva_walk(pool, count_regions, &regions), KVA_OK);
    CHECK(regions > 2);
    CHECK(kva_usable_size(pool, b) == MiB && kva_usable_size(pool, a) >= 300);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
    CHECK_NO_LEAKS();
}

/* Destroying a pool goes on past the driver's refusals, and gives back all the driver lets it:
 * with the context push refused, everything (the calls it makes need no context); with one
 * granule's unmap refused, every other granule, and that granule's handle, whose memory the
 * driver frees at its last unmap; only that mapping and the reservation under it remain. */
static void test_destroy_past_refusals(void) {
    kva_pool *pool = cuda_pool(64 * MiB, 0, 0);
    void *big;
    CHECK_STATUS(kva_alloc(pool, 8 * MiB, &big), KVA_OK);
    CHECK(fake.mappings() == 8 * MiB / granule);
    fake.fail("cuCtxPushCurrent_v2", 1, CUDA_ERROR_INVALID_CONTEXT);
    kva_pool_destroy(pool);
    fake.disarm();
    CHECK(strcmp(fake.last_fired(), "cuCtxPushCurrent_v2") == 0);
    CHECK_NO_LEAKS();

    pool = cuda_pool(64 * MiB, 0, 0);
    CHECK_STATUS(kva_alloc(pool, 8 * MiB, &big), KVA_OK);
    fake.fail("cuMemUnmap", 2, CUDA_ERROR_UNKNOWN);
    kva_pool_destroy(pool);
    fake.disarm();
    CHECK(strcmp(fake.last_fired(), "cuMemUnmap") == 0);
    /* The granule the driver would not unmap kept its reservation from being freed; the
     * context's last release then reset the device, which freed the granule's memory. */
    CHECK(fake.mappings() == 0 && fake.live_handles() == 0 && fake.reservations() == 1);
    CHECK(fake.used_bytes() == 0 && fake.retains(0) == 0 && fake.context_depth() == 0);
    fake.reset(); /* what the driver would do with the reservation when the process ends */
    CHECK_NO_LEAKS();
}

/* CUDA does not survive fork: a child forked from a process with a CUDA pool and a pinned host
 * pool makes no driver call for them. What needs one is refused, saying why; destroying them
 * frees what is the child's and leaves the parent's device memory to the parent. */
static int forked_child(kva_pool *device_pool, kva_pool *pinned, void *mapped) {
    unsigned long before = fake.calls("*");
    void *more;
    CHECK_STATUS(kva_alloc(device_pool, 16 * MiB, &more), KVA_ERR_BACKEND); /* would map granules */
    CHECK_ERROR_SAYS("forked");
    CHECK_STATUS(kva_free(device_pool, mapped), KVA_OK); /* its granules stay mapped: no call */
    CHECK_STATUS(kva_trim(device_pool), KVA_ERR_BACKEND);
    void *host;
    CHECK_STATUS(kva_alloc(pinned, 4096, &host), KVA_OK); /* host memory: the child's copy */
    memset(host, 7, 4096);
    kva_pool_destroy(device_pool);
    kva_pool_destroy(pinned);
    /* Nor a new pool: the driver was initialized by the parent. */
    kva_config cfg = cuda_config(64 * MiB);
    kva_pool *fresh = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &fresh), KVA_ERR_BACKEND);
    CHECK_ERROR_SAYS("forked");
    CHECK(fresh == NULL);
    CHECK(fake.calls("*") == before);
    return check_failures ? 1 : 0;
}

static void test_forked_child(void) {
    kva_pool *device_pool = cuda_pool(64 * MiB, 0, 0), *pinned = NULL;
    kva_config host = {0};
    kva_config_init(&host);
    host.capacity = 4 * MiB;
    host.pin = 1;
    CHECK_STATUS(kva_pool_create(&host, &pinned), KVA_OK);
    REQUIRE(pinned != NULL);
    void *mapped;
    CHECK_STATUS(kva_alloc(device_pool, 8 * MiB, &mapped), KVA_OK);
    fflush(stderr);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) _exit(forked_child(device_pool, pinned, mapped));
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* The parent's pools are as they were, and go as usual. */
    CHECK(fake.mappings() == 8 * MiB / granule && fake.registrations() == 1);
    CHECK_STATUS(kva_free(device_pool, mapped), KVA_OK);
    check_agrees(device_pool);
    kva_pool_destroy(device_pool);
    kva_pool_destroy(pinned);
    CHECK_NO_LEAKS();
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s path/to/libfakecuda.so\n", argv[0]);
        return 2;
    }
    load_fake(argv[1]);
    test_no_driver();
    test_no_gpu(argv[1]);
    test_config();
    test_on_demand();
    test_shared_granule();
    test_watermark();
    test_prefault();
    test_out_of_memory();
    test_commit_failures();
    test_creation_sweep();
    test_random_with_faults();
    test_pin();
    test_callers_context();
    test_introspection();
    test_destroy_past_refusals();
    test_forked_child();
    return CHECK_DONE();
}
