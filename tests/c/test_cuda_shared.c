/*
 * test_cuda_shared.c — shared CUDA pools (kva_config.shared with KVA_BACKEND_CUDA) against the
 * fake driver of tests/fake_cuda (its path is argv[1]), whose shareable allocations are memfds:
 * two real processes see the same device bytes. The owner allocates and copies a pattern into a
 * block, exports the allocation (kva_pool_shared_fd) and passes the descriptor over a Unix socket
 * to this test executed anew, which imports it (kva_shared_attach_cuda) at its own device
 * address (the owner's address is taken in the child first, so it cannot be reused), reads the
 * pattern, writes an answer the owner then reads. Also: an allocation imported twice, descriptors
 * that are no export, wrong lengths, a pool that is not shared, an export the driver refuses, and
 * the RDMA flag where the device offers it. And a fork while another thread is inside the driver
 * (loading it, importing an allocation): the child finds the library's locks free and is told
 * that CUDA does not survive fork, instead of waiting forever.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "check.h"
#include "fd_passing.h"
#include "cuda_driver.h"
#include "pool_fingerprint.h"

#define MiB ((size_t)1 << 20)

typedef struct handoff {
    uint64_t read_offset, write_offset, length, mapped;
    uintptr_t owner_base;
} handoff;

static CUresult (*htod)(CUdeviceptr, const void *, size_t);
static CUresult (*dtoh)(void *, CUdeviceptr, size_t);
static CUresult (*retain)(CUcontext *, CUdevice);
static CUresult (*push)(CUcontext);
static CUresult (*pop)(CUcontext *);
static void (*fake_fail)(const char *, unsigned long, int);
static void (*fake_disarm)(void);
static void (*fake_set_rdma)(int);
static size_t (*fake_rdma_allocations)(void);
static size_t (*fake_live_handles)(void);
static size_t (*fake_reservations)(void);
static void (*fake_gate)(const char *, int);
static void (*fake_gate_await)(void);
static CUcontext context;

static void load_fake(const char *path) {
    setenv("KVA_CUDA_DRIVER", path, 1);
    void *fake = dlopen(path, RTLD_NOW);
    REQUIRE(fake != NULL);
    *(void **)&htod = dlsym(fake, "cuMemcpyHtoD_v2");
    *(void **)&dtoh = dlsym(fake, "cuMemcpyDtoH_v2");
    *(void **)&retain = dlsym(fake, "cuDevicePrimaryCtxRetain");
    *(void **)&push = dlsym(fake, "cuCtxPushCurrent_v2");
    *(void **)&pop = dlsym(fake, "cuCtxPopCurrent_v2");
    *(void **)&fake_fail = dlsym(fake, "fake_cuda_fail");
    *(void **)&fake_disarm = dlsym(fake, "fake_cuda_disarm");
    *(void **)&fake_set_rdma = dlsym(fake, "fake_cuda_set_rdma");
    *(void **)&fake_rdma_allocations = dlsym(fake, "fake_cuda_rdma_allocations");
    *(void **)&fake_live_handles = dlsym(fake, "fake_cuda_live_handles");
    *(void **)&fake_reservations = dlsym(fake, "fake_cuda_reservations");
    *(void **)&fake_gate = dlsym(fake, "fake_cuda_gate");
    *(void **)&fake_gate_await = dlsym(fake, "fake_cuda_gate_await");
    REQUIRE(htod && dtoh && retain && push && pop && fake_fail && fake_disarm && fake_set_rdma &&
            fake_rdma_allocations && fake_live_handles && fake_reservations && fake_gate && fake_gate_await);
}

/* Copies to or from device memory with the device's primary context current. */
static void copy(void *host, uintptr_t device, size_t length, int to_device) {
    if (!context) {
        CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(RTLD_DEFAULT, "cuInit");
        if (init) init(0);
        REQUIRE(retain(&context, 0) == CUDA_SUCCESS);
    }
    REQUIRE(push(context) == CUDA_SUCCESS);
    CUresult r = to_device ? htod(device, host, length) : dtoh(host, device, length);
    CHECK(r == CUDA_SUCCESS);
    pop(NULL);
}

static unsigned char *pattern(size_t length, unsigned mul, unsigned add) {
    unsigned char *p = malloc(length);
    REQUIRE(p);
    for (size_t i = 0; i < length; i++) p[i] = (unsigned char)(i * mul + add);
    return p;
}

/* The second process. */
static int importer(int sock, const char *fake_path) {
    hang_guard("the importing process", HANG_GUARD_SECONDS);
    load_fake(fake_path);
    handoff h;
    int fd = receive_fd(sock, &h, sizeof h);
    /* The owner's device address is taken here first: the import must land elsewhere. */
    void *taken = mmap((void *)h.owner_base, MiB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    CHECK(taken == (void *)h.owner_base);
    kva_shared_map *map = NULL;
    CHECK_STATUS(kva_shared_attach_cuda(0, fd, h.mapped, &map), KVA_OK);
    REQUIRE(map);
    uintptr_t base = (uintptr_t)kva_shared_base(map);
    CHECK(base != h.owner_base && kva_shared_length(map) == h.mapped);

    /* One allocation, one import: the same descriptor, or a copy of it, is refused. */
    kva_shared_map *again = (kva_shared_map *)0x1;
    size_t reservations = fake_reservations();
    CHECK_STATUS(kva_shared_attach_cuda(0, fd, h.mapped, &again), KVA_ERR_INVALID);
    int copy_fd = dup(fd);
    CHECK_STATUS(kva_shared_attach_cuda(0, copy_fd, h.mapped, &again), KVA_ERR_INVALID);
    CHECK(again == (kva_shared_map *)0x1 && fake_reservations() == reservations);

    unsigned char *seen = malloc(h.length), *expected = pattern(h.length, 7, 1), *answer = pattern(h.length, 3, 5);
    REQUIRE(seen);
    copy(seen, base + h.read_offset, h.length, 0);
    CHECK(memcmp(seen, expected, h.length) == 0);
    copy(answer, base + h.write_offset, h.length, 1);

    kva_shared_detach(map);
    /* Detached, the allocation can be imported anew. */
    CHECK_STATUS(kva_shared_attach_cuda(0, copy_fd, h.mapped, &map), KVA_OK);
    kva_shared_detach(map);
    close(copy_fd);
    close(fd);
    char byte = 1;
    REQUIRE(write(sock, &byte, 1) == 1);
    free(seen);
    free(expected);
    free(answer);
    return CHECK_DONE();
}

static kva_config shared_config(size_t capacity) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.backend = KVA_BACKEND_CUDA;
    cfg.capacity = capacity;
    cfg.shared = 1;
    return cfg;
}

static void test_two_processes(const char *fake_path) {
    kva_config cfg = shared_config(32 * MiB);
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.backend == KVA_BACKEND_CUDA && st.mapped_bytes == 32 * MiB); /* mapped whole, at once */
    unsigned char *base = NULL;
    CHECK_STATUS(kva_pool_base(pool, (void **)&base), KVA_OK);
    size_t length = 3 * MiB + 99;
    void *mine = NULL, *theirs = NULL;
    CHECK_STATUS(kva_alloc(pool, length, &mine), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, length, &theirs), KVA_OK);
    unsigned char *written = pattern(length, 7, 1);
    copy(written, (uintptr_t)mine, length, 1);

    int fd = -1;
    CHECK_STATUS(kva_pool_shared_fd(pool, &fd), KVA_OK);
    REQUIRE(fd >= 0);
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    int sock;
    pid_t pid = start_peer("/proc/self/exe", "--import", fake_path, &sock);
    handoff h = {.read_offset = (uint64_t)((unsigned char *)mine - base),
                 .write_offset = (uint64_t)((unsigned char *)theirs - base),
                 .length = length,
                 .mapped = st.mapped_bytes,
                 .owner_base = (uintptr_t)base};
    send_fd(sock, fd, &h, sizeof h);
    close(fd);
    char byte = 0;
    CHECK(read(sock, &byte, 1) == 1 && byte == 1);
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(sock);
    unsigned char *seen = malloc(length), *expected = pattern(length, 3, 5);
    REQUIRE(seen);
    copy(seen, (uintptr_t)theirs, length, 0);
    CHECK(memcmp(seen, expected, length) == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_trim(pool), KVA_OK); /* the one allocation stays: the pool is resident */
    kva_pool_destroy(pool);
    CHECK(fake_live_handles() == 0);
    free(written);
    free(seen);
    free(expected);
}

static void test_refusals(void) {
    /* A pool that is not shared has nothing to export; the call changes nothing. */
    kva_config cfg = shared_config(16 * MiB);
    cfg.shared = 0;
    kva_pool *plain = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &plain), KVA_OK);
    REQUIRE(plain);
    void *p = NULL;
    CHECK_STATUS(kva_alloc(plain, 4096, &p), KVA_OK);
    snapshot before = take(plain);
    int fd = 4242;
    CHECK_STATUS(kva_pool_shared_fd(plain, &fd), KVA_ERR_INVALID);
    CHECK(fd == 4242 && unchanged(plain, &before));
    kva_pool_destroy(plain);

    kva_config scfg = shared_config(16 * MiB);
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&scfg, &pool), KVA_OK);
    REQUIRE(pool);
    /* The driver refuses the export: a status, no descriptor. */
    fake_fail("cuMemExportToShareableHandle", 1, CUDA_ERROR_NOT_SUPPORTED);
    fd = 4242;
    CHECK_STATUS(kva_pool_shared_fd(pool, &fd), KVA_ERR_BACKEND);
    CHECK(fd == 4242);
    fake_disarm();
    CHECK_STATUS(kva_pool_shared_fd(pool, &fd), KVA_OK);

    /* What is no export, or a wrong length: refused with nothing imported or reserved. */
    size_t handles = fake_live_handles(), reservations = fake_reservations();
    kva_shared_map *map = (kva_shared_map *)0x1;
    int pipes[2];
    REQUIRE(pipe(pipes) == 0);
    CHECK_STATUS(kva_shared_attach_cuda(0, pipes[0], 16 * MiB, &map), KVA_ERR_INVALID);
    close(pipes[0]);
    close(pipes[1]);
    int host = memfd_create("kvalloc.pool", MFD_CLOEXEC);
    REQUIRE(host >= 0 && ftruncate(host, 16 * MiB) == 0);
    CHECK_STATUS(kva_shared_attach_cuda(0, host, 16 * MiB, &map), KVA_ERR_INVALID);
    close(host);
    CHECK_STATUS(kva_shared_attach_cuda(0, fd, 0, &map), KVA_ERR_INVALID);
    CHECK_STATUS(kva_shared_attach_cuda(0, fd, 16 * MiB + 4096, &map), KVA_ERR_INVALID);
    CHECK_STATUS(kva_shared_attach_cuda(0, fd, 32 * MiB, &map), KVA_ERR_BACKEND); /* past the allocation */
    CHECK_STATUS(kva_shared_attach_cuda(0, -1, 16 * MiB, &map), KVA_ERR_INVALID);
    CHECK_STATUS(kva_shared_attach_cuda(-1, fd, 16 * MiB, &map), KVA_ERR_INVALID);
    CHECK_STATUS(kva_shared_attach_cuda(0, 1000, 16 * MiB, &map), KVA_ERR_INVALID);
    CHECK_STATUS(kva_shared_attach_cuda(0, fd, 16 * MiB, NULL), KVA_ERR_INVALID);
    CHECK(map == (kva_shared_map *)0x1);
    CHECK(fake_live_handles() == handles && fake_reservations() == reservations);
    close(fd);
    kva_pool_destroy(pool);

    /* The shareable allocation refused at creation: no pool, nothing left. */
    fake_fail("cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY);
    pool = NULL;
    CHECK_STATUS(kva_pool_create(&scfg, &pool), KVA_ERR_NOMEM);
    CHECK(pool == NULL && fake_live_handles() == 0);
    fake_disarm();
    /* External CUDA memory is the caller's: it cannot be made shareable here. */
    scfg.external = (void *)(uintptr_t)0x7f0000000000;
    CHECK_STATUS(kva_pool_create(&scfg, &pool), KVA_ERR_INVALID);
}

/* GPUDirect RDMA on the allocation exactly when the device reports it with VMM. */
static void test_rdma_flag(void) {
    kva_config cfg = shared_config(8 * MiB);
    for (int offered = 0; offered <= 1; offered++) {
        fake_set_rdma(offered);
        kva_pool *pool = NULL;
        CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
        CHECK(fake_rdma_allocations() == (size_t)offered);
        kva_pool_destroy(pool);
    }
    fake_set_rdma(0);
}

/* ---- fork while another thread is inside the driver ------------------------------------------- */

typedef struct gated_call {
    kva_config cfg;
    kva_pool *pool;
    int fd;
    size_t length;
    kva_shared_map *map;
    kva_status st;
} gated_call;

static void *create_pool(void *arg) {
    gated_call *g = arg;
    g->st = kva_pool_create(&g->cfg, &g->pool);
    return NULL;
}

static void *attach(void *arg) {
    gated_call *g = arg;
    g->st = kva_shared_attach_cuda(0, g->fd, g->length, &g->map);
    return NULL;
}

/* Opens the fake's gate a little after the fork has begun, so that the fork comes while the
 * gated call is inside the driver, holding whatever lock the library holds around it. */
static void *open_gate_soon(void *arg) {
    (void)arg;
    usleep(200 * 1000);
    fake_gate(NULL, 0);
    return NULL;
}

/* Forks while a call waits at the fake's closed gate; the child runs `in_child`, which must
 * come back (a lock left held by the parent's other thread would keep it waiting forever) and
 * return 1. */
static void fork_past_gate(const char *what, int (*in_child)(void)) {
    fake_gate_await();
    pthread_t opener;
    REQUIRE(pthread_create(&opener, NULL, open_gate_soon, NULL) == 0);
    fflush(stderr);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        hang_guard(what, HANG_GUARD_SECONDS / 3); /* before the parent's own guard */
        _exit(in_child() ? 0 : 1);
    }
    REQUIRE(pthread_join(opener, NULL) == 0);
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "%s: the child failed (status %#x)\n", what, (unsigned)status);
        check_failures++;
    }
}

/* A CUDA pool in a child: refused, the driver having been loaded before the fork. */
static int child_creates_pool(void) {
    kva_config cfg = shared_config(16 * MiB);
    kva_pool *pool = NULL;
    kva_status st = kva_pool_create(&cfg, &pool);
    if (st != KVA_ERR_BACKEND || pool) fprintf(stderr, "child: CUDA pool gave %d (%s)\n", (int)st, kva_last_error());
    return st == KVA_ERR_BACKEND && !pool;
}

/* An import in a child: refused for the same reason (a pipe: no allocation of the parent's
 * imports, so that only the driver can refuse it). */
static int child_imports(void) {
    int pipes[2];
    if (pipe(pipes) != 0) return 0;
    kva_shared_map *map = NULL;
    kva_status st = kva_shared_attach_cuda(0, pipes[0], 16 * MiB, &map);
    if (st != KVA_ERR_BACKEND || map) fprintf(stderr, "child: import gave %d (%s)\n", (int)st, kva_last_error());
    return st == KVA_ERR_BACKEND && !map;
}

/* The first CUDA call of this process: the driver is loaded (cuInit) while the process forks. */
static void test_fork_while_loading(void) {
    gated_call g = {.cfg = shared_config(16 * MiB)};
    fake_gate("cuInit", 1);
    pthread_t loader;
    REQUIRE(pthread_create(&loader, NULL, create_pool, &g) == 0);
    fork_past_gate("a child forked while the driver loads", child_creates_pool);
    REQUIRE(pthread_join(loader, NULL) == 0);
    CHECK_STATUS(g.st, KVA_OK);
    kva_pool_destroy(g.pool);
}

static void test_fork_while_importing(void) {
    kva_config cfg = shared_config(16 * MiB);
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    gated_call g = {.fd = -1, .length = 16 * MiB};
    CHECK_STATUS(kva_pool_shared_fd(pool, &g.fd), KVA_OK);
    fake_gate("cuMemImportFromShareableHandle", 1);
    pthread_t importer_thread;
    REQUIRE(pthread_create(&importer_thread, NULL, attach, &g) == 0);
    fork_past_gate("a child forked while an allocation is imported", child_imports);
    REQUIRE(pthread_join(importer_thread, NULL) == 0);
    CHECK_STATUS(g.st, KVA_OK);
    kva_shared_detach(g.map);
    close(g.fd);
    kva_pool_destroy(pool);
    CHECK(fake_live_handles() == 0);
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--import") == 0) return importer(atoi(argv[2]), argv[3]);
    if (argc < 2) {
        fprintf(stderr, "usage: %s path/to/libfakecuda.so\n", argv[0]);
        return 2;
    }
    hang_guard("test_cuda_shared", HANG_GUARD_SECONDS);
    load_fake(argv[1]);
    test_fork_while_loading(); /* first: it loads the driver */
    test_two_processes(argv[1]);
    test_refusals();
    test_rdma_flag();
    test_fork_while_importing();
    return CHECK_DONE();
}
