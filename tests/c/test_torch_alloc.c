/*
 * test_torch_alloc.c — libkvalloc_torch's entry points, called as torch calls them, against the
 * fake driver (argv[1]) whose streams complete their work only when the test says so
 * (fake_cuda_stream_hold): a block freed on a stream with work pending is never handed to
 * another stream until that work is done, may be taken back on its own stream at once, and goes
 * back to the pool once its event completes; a full pool waits for pending frees before it
 * fails; foreign and repeated frees are ignored and counted. The device memory is the fake's,
 * reserved PROT_NONE: the allocator never touches it.
 */
#include <dlfcn.h>
#include <stdint.h>

#include "check.h"
#include "cuda_driver.h"
#include "kvalloc_torch.h"

#define MiB ((size_t)1 << 20)

static CUresult (*stream_create)(kva_torch_stream *, unsigned);
static void (*stream_hold)(kva_torch_stream, int);
static unsigned long (*live_events)(void);
static CUresult (*init)(unsigned);
static CUresult (*retain)(CUcontext *, CUdevice);
static CUresult (*push)(CUcontext);
static CUresult (*pop)(CUcontext *);
static void (*fake_fail)(const char *, unsigned long, int);

static size_t pending_blocks(void) {
    size_t live = 0, bytes = 0, blocks = 0;
    REQUIRE(kva_torch_stats(0, &live, &bytes, &blocks) == 0);
    return blocks;
}

static kva_torch_stream new_stream(void) {
    CUcontext ctx;
    REQUIRE(retain(&ctx, 0) == CUDA_SUCCESS && push(ctx) == CUDA_SUCCESS);
    kva_torch_stream s = NULL;
    REQUIRE(stream_create(&s, 0) == CUDA_SUCCESS);
    pop(NULL);
    return s;
}

static void test_streams(void) {
    kva_torch_stream a = new_stream(), b = new_stream();
    void *p = kva_torch_alloc(MiB, 0, a);
    REQUIRE(p != NULL);
    CHECK(((uintptr_t)p & 511) == 0);

    /* Stream a has work queued after p's last use: p must not reach stream b. */
    stream_hold(a, 1);
    kva_torch_free(p, MiB, 0, a);
    CHECK(pending_blocks() == 1);
    void *q = kva_torch_alloc(MiB, 0, b);
    CHECK(q != NULL && q != p);
    CHECK(pending_blocks() == 1);

    /* On its own stream it may come back at once: stream order makes that safe. */
    void *again = kva_torch_alloc(MiB, 0, a);
    CHECK(again == p);
    CHECK(pending_blocks() == 0);
    kva_torch_free(again, MiB, 0, a);
    kva_torch_free(q, MiB, 0, b);
    CHECK(pending_blocks() == 2); /* q too, though b's work is done: until the next sweep */

    /* a's work done: the next allocation on any stream returns both to the pool first. */
    stream_hold(a, 0);
    void *r = kva_torch_alloc(4096, 0, b);
    CHECK(r != NULL);
    CHECK(pending_blocks() == 0);
    kva_torch_free(r, 4096, 0, b);
    void *s = kva_torch_alloc(1 << 20, 0, b); /* too large to take r back: r returns to the pool */
    CHECK(s != NULL && pending_blocks() == 0);
    size_t live = 0;
    kva_torch_stats(0, &live, NULL, NULL);
    CHECK(live == MiB);
    kva_torch_free(s, 1 << 20, 0, b);
}

/* A pool full of blocks pending on a busy stream: an allocation waits for them, then succeeds. */
static void test_full_pool_waits(void) {
    kva_torch_stream a = new_stream(), b = new_stream();
    void *blocks[64];
    int n = 0;
    while (n < 64 && (blocks[n] = kva_torch_alloc(4 * MiB, 0, a)) != NULL) n++;
    CHECK(n > 4 && n < 64); /* the pool is full before 64 */
    stream_hold(a, 1);
    for (int i = 0; i < n; i++) kva_torch_free(blocks[i], 4 * MiB, 0, a);
    CHECK(pending_blocks() == (size_t)n);
    void *p = kva_torch_alloc(4 * MiB, 0, b); /* waits for a's events: the fake completes them */
    CHECK(p != NULL);
    CHECK(pending_blocks() == 0);
    kva_torch_free(p, 4 * MiB, 0, b);
    stream_hold(a, 0);

    /* Too large for the pool at all: NULL and a reason. */
    CHECK(kva_torch_alloc((size_t)1 << 40, 0, b) == NULL);
    CHECK(strlen(kva_torch_last_error()) > 0);
}

static void test_bad_input(void) {
    kva_torch_stream a = new_stream();
    unsigned long rejected = kva_torch_rejected_frees();
    size_t before = pending_blocks();
    int local;
    kva_torch_free(&local, 8, 0, a); /* not this allocator's */
    void *p = kva_torch_alloc(8192, 0, a);
    REQUIRE(p);
    stream_hold(a, 1);
    kva_torch_free(p, 8192, 0, a);
    kva_torch_free(p, 8192, 0, a);               /* pending already: a double free */
    kva_torch_free((char *)p + 512, 8192, 0, a); /* inside a block, not its start */
    kva_torch_free(p, 8192, 7, a);               /* a device with no pool */
    CHECK(kva_torch_rejected_frees() == rejected + 4);
    CHECK(pending_blocks() == before + 1);
    stream_hold(a, 0);
    kva_torch_free(NULL, 0, 0, a); /* torch may free NULL: nothing happens */
    CHECK(kva_torch_rejected_frees() == rejected + 4);

    CHECK(kva_torch_alloc(0, 0, a) == NULL);
    CHECK(kva_torch_alloc(64, -1, a) == NULL);
    CHECK(kva_torch_alloc(64, 3, a) == NULL); /* the fake has one GPU */
    CHECK(kva_torch_configure(MiB) == -1);    /* the pool exists: its capacity is fixed */
    /* A capacity no pool can have is refused as such, pool or not. */
    CHECK(kva_torch_configure(100) == -2);
    CHECK(kva_torch_configure((size_t)512 << 31) == -2);
    CHECK(kva_torch_configure(SIZE_MAX) == -2);
    CHECK(strstr(kva_torch_last_error(), "capacity") != NULL);

    /* An event the driver will not record: the stream is waited for and the block goes back. */
    void *q = kva_torch_alloc(8192, 0, a);
    REQUIRE(q);
    size_t pending = pending_blocks();
    fake_fail("cuEventRecord", 1, CUDA_ERROR_OUT_OF_MEMORY);
    kva_torch_free(q, 8192, 0, a);
    CHECK(pending_blocks() == pending);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s path/to/libfakecuda.so\n", argv[0]);
        return 2;
    }
    hang_guard("test_torch_alloc", HANG_GUARD_SECONDS);
    setenv("KVA_CUDA_DRIVER", argv[1], 1);
    void *fake = dlopen(argv[1], RTLD_NOW);
    REQUIRE(fake);
    *(void **)&stream_create = dlsym(fake, "cuStreamCreate");
    *(void **)&stream_hold = dlsym(fake, "fake_cuda_stream_hold");
    *(void **)&live_events = dlsym(fake, "fake_cuda_live_events");
    *(void **)&init = dlsym(fake, "cuInit");
    *(void **)&retain = dlsym(fake, "cuDevicePrimaryCtxRetain");
    *(void **)&push = dlsym(fake, "cuCtxPushCurrent_v2");
    *(void **)&pop = dlsym(fake, "cuCtxPopCurrent_v2");
    *(void **)&fake_fail = dlsym(fake, "fake_cuda_fail");
    REQUIRE(stream_create && stream_hold && live_events && init && retain && push && pop && fake_fail);
    REQUIRE(init(0) == CUDA_SUCCESS);
    CHECK(kva_torch_stats(0, NULL, NULL, NULL) == -1); /* no pool before the first allocation */
    CHECK(kva_torch_configure(64 * MiB) == 0);
    test_streams();
    test_full_pool_waits();
    test_bad_input();
    /* Events are reused: many frees later, no more exist than the pending blocks' and the
     * 256 kept idle. */
    kva_torch_stream a = new_stream();
    unsigned long events_before = live_events();
    for (int i = 0; i < 2000; i++) {
        void *p = kva_torch_alloc(4096 + (size_t)(i % 7) * 4096, 0, a);
        REQUIRE(p);
        kva_torch_free(p, 4096, 0, a);
    }
    CHECK(live_events() <= events_before + 1);
    CHECK(live_events() <= pending_blocks() + 256);
    return CHECK_DONE();
}
