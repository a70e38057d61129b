/*
 * test_shared.c — host pools in a shared memory object (kva_config.shared). Two real
 * processes: the owner allocates and writes, then passes the pool's descriptor over a Unix socket
 * (SCM_RIGHTS) to a second process, this test executed anew (so it inherits nothing but the
 * socket), which attaches, reads the owner's bytes at its own address and writes its answer
 * into another block, which the owner then reads. Also: the seals that keep an attacher from
 * shrinking the memory under the owner, every descriptor that is not a kvalloc shared pool
 * refused with nothing mapped, the page choices, fault injection on the memfd path, and a pool
 * that is not shared, and a child forked from the owner, whose copy of the allocator refuses to
 * hand out or give back the owner's bytes. Shared CUDA pools: test_cuda_shared.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "check.h"
#include "child.h"
#include "kvalloc_kv.h"
#include "kvalloc_var.h"
#include "fd_passing.h"
#include "os.h"
#include "pool_fingerprint.h"
#include "pool_range.h"

#define MiB ((size_t)1 << 20)

typedef struct handoff {
    uint64_t read_offset, write_offset, length;
    uintptr_t owner_base;
} handoff;

/* The second process: attaches, checks the owner's pattern, answers with its own. */
static int attacher(int sock) {
    hang_guard("the attaching process", HANG_GUARD_SECONDS);
    handoff h;
    int fd = receive_fd(sock, &h, sizeof h);
    /* The owner's address is taken here first: the map must land elsewhere. */
    void *taken = mmap((void *)h.owner_base, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    CHECK(taken == (void *)h.owner_base);
    kva_shared_map *map = NULL;
    CHECK_STATUS(kva_shared_attach(fd, &map), KVA_OK);
    REQUIRE(map);
    /* The descriptor reached this process sealed: it cannot shrink the memory under the owner. */
    CHECK(ftruncate(fd, 4096) != 0 && errno == EPERM);
    close(fd); /* the map does not need it */
    unsigned char *base = kva_shared_base(map);
    CHECK(kva_shared_length(map) >= h.read_offset + h.length);
    CHECK((uintptr_t)base != h.owner_base);
    size_t wrong = 0;
    for (size_t i = 0; i < h.length; i++) wrong += base[h.read_offset + i] != (unsigned char)(i * 7 + 1);
    CHECK(wrong == 0);
    for (size_t i = 0; i < h.length; i++) base[h.write_offset + i] = (unsigned char)(i * 3 + 5);
    char byte = 1;
    REQUIRE(write(sock, &byte, 1) == 1);
    kva_shared_detach(map);
    return CHECK_DONE();
}

static void test_two_processes(const char *self) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = 64 * MiB;
    cfg.shared = 1;
    cfg.name = "shared-test";
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    unsigned char *base = NULL;
    CHECK_STATUS(kva_pool_base(pool, (void **)&base), KVA_OK);
    size_t length = 3 * MiB + 123;
    unsigned char *mine = NULL, *theirs = NULL;
    CHECK_STATUS(kva_alloc(pool, length, (void **)&mine), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, length, (void **)&theirs), KVA_OK);
    for (size_t i = 0; i < length; i++) mine[i] = (unsigned char)(i * 7 + 1);

    int fd = -1;
    CHECK_STATUS(kva_pool_shared_fd(pool, &fd), KVA_OK);
    REQUIRE(fd >= 0);
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    /* The seals hold for whoever has the descriptor. */
    CHECK(ftruncate(fd, 4096) != 0 && errno == EPERM);
    CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) != 0);

    int sock;
    pid_t pid = start_peer(self, "--attach", NULL, &sock);
    handoff h = {.read_offset = (uint64_t)(mine - base),
                 .write_offset = (uint64_t)(theirs - base),
                 .length = length,
                 .owner_base = (uintptr_t)base};
    send_fd(sock, fd, &h, sizeof h);
    close(fd);
    char byte = 0;
    CHECK(read(sock, &byte, 1) == 1 && byte == 1);
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(sock);
    size_t wrong = 0;
    for (size_t i = 0; i < length; i++) wrong += theirs[i] != (unsigned char)(i * 3 + 5);
    CHECK(wrong == 0);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    kva_pool_destroy(pool);
}

/* A pool of capacity bytes of small pages, shared (shared 1) or private. */
static kva_pool *small_pages_pool(size_t capacity, int shared) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.shared = shared;
    cfg.pages = KVA_PAGES_SMALL;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    return pool;
}

/* An attached map outlives the owner's pool: the object lives while a mapping does. */
static void test_map_outlives_pool(void) {
    kva_pool *pool = small_pages_pool(4 * MiB, 1);
    unsigned char *block = NULL;
    CHECK_STATUS(kva_alloc(pool, 8192, (void **)&block), KVA_OK);
    void *base = NULL;
    kva_pool_base(pool, &base);
    size_t offset = (size_t)(block - (unsigned char *)base);
    memset(block, 0x3c, 8192);
    int fd = -1;
    CHECK_STATUS(kva_pool_shared_fd(pool, &fd), KVA_OK);
    kva_shared_map *map = NULL;
    CHECK_STATUS(kva_shared_attach(fd, &map), KVA_OK);
    close(fd);
    REQUIRE(map);
    CHECK(kva_shared_base(map) != base);
    kva_pool_destroy(pool);
    unsigned char *seen = (unsigned char *)kva_shared_base(map) + offset;
    CHECK(seen[0] == 0x3c && seen[8191] == 0x3c);
    kva_shared_detach(map);
    kva_shared_detach(NULL);
    CHECK(kva_shared_base(NULL) == NULL && kva_shared_length(NULL) == 0);
}

/* Memory given back inside a live block (the KV trim's path) goes back from the shared object
 * itself: an attached process reads zero there, and the object holds fewer pages. */
static void test_range_release(void) {
    kva_pool *pool = small_pages_pool(8 * MiB, 1);
    CHECK(kva_pool_range_unit(pool) == 4096);
    unsigned char *block = NULL;
    CHECK_STATUS(kva_alloc(pool, 2 * MiB, (void **)&block), KVA_OK);
    memset(block, 0x77, 2 * MiB);
    int fd = -1;
    CHECK_STATUS(kva_pool_shared_fd(pool, &fd), KVA_OK);
    kva_shared_map *map = NULL;
    CHECK_STATUS(kva_shared_attach(fd, &map), KVA_OK);
    REQUIRE(map);
    void *base = NULL;
    kva_pool_base(pool, &base);
    unsigned char *seen = (unsigned char *)kva_shared_base(map) + (block - (unsigned char *)base);
    struct stat before, after;
    REQUIRE(fstat(fd, &before) == 0);
    CHECK_STATUS(kva_pool_range_release(pool, block + MiB, MiB), KVA_OK);
    REQUIRE(fstat(fd, &after) == 0);
    CHECK(after.st_blocks < before.st_blocks);
    CHECK(seen[MiB] == 0 && seen[2 * MiB - 1] == 0 && seen[MiB - 1] == 0x77);
    CHECK_STATUS(kva_pool_range_take(pool, block + MiB, MiB), KVA_OK);
    block[MiB] = 0x55;
    CHECK(seen[MiB] == 0x55);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_shared_detach(map);
    close(fd);
    kva_pool_destroy(pool);
}

/* What the owner holds when it forks: a shared pool and a private one, slab objects this
 * thread's cache has handed out (its current word has more), one it freed, and a block. */
static struct {
    kva_pool *shared, *private_pool;
    void *objects[4];
    unsigned char *block;
    kva_kv *kv; /* a KV cache over the shared pool, with one sequence */
    kva_kv_seq seq;
    kva_var *var; /* a variable-size pool over it, with one range handed out */
    void *range;
} forked;

static void *alloc_in_a_new_thread(void *pool) {
    void *p = NULL;
    return (void *)(uintptr_t)kva_alloc(pool, 64, &p);
}

/* The child: every call that would hand out or give back the shared memory is refused, the
 * fast paths included (this thread's cache of the pool still had free objects and owned the
 * words of the objects freed); what only reads works; the private pool is the child's own. */
static int forked_child(void) {
    kva_pool *pool = forked.shared;
    void *p = NULL;
    CHECK_STATUS(kva_alloc(pool, 64, &p), KVA_ERR_BACKEND);
    CHECK(p == NULL);
    CHECK_STATUS(kva_alloc(pool, MiB, &p), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_alloc_exact(pool, 3 * 4096, &p), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_alloc_aligned(pool, 64, 64, &p), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_alloc_array(pool, 2, 32, &p), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_free(pool, forked.objects[1]), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_free(pool, forked.block), KVA_ERR_BACKEND); /* its discard would zero the owner's */
    CHECK_STATUS(kva_trim(pool), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_pool_range_release(pool, forked.block, 4096), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_pool_range_take(pool, forked.block, 4096), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_thread_flush(pool), KVA_OK);
    pthread_t thread;
    void *answer = NULL;
    REQUIRE(pthread_create(&thread, NULL, alloc_in_a_new_thread, pool) == 0);
    REQUIRE(pthread_join(thread, &answer) == 0);
    CHECK((kva_status)(uintptr_t)answer == KVA_ERR_BACKEND);
    kva_stats st;
    CHECK_STATUS(kva_get_stats(pool, &st), KVA_OK);
    CHECK(st.live_allocations == 6); /* the owner's at the fork, the KV and variable-size pools' too */
    CHECK(kva_usable_size(pool, forked.block) == MiB);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    CHECK(forked.block[0] == 0x5a); /* the memory itself is there to read */
    CHECK_STATUS(kva_alloc(forked.private_pool, 64, &p), KVA_OK);
    CHECK_STATUS(kva_free(forked.private_pool, p), KVA_OK);
    /* The KV cache over it is a copy of the owner's: every call that would change it is
     * refused; those that only read it answer. */
    kva_kv *kv = forked.kv;
    kva_kv_seq seq = 0;
    kva_kv_copy copy;
    uint64_t key = 7;
    uint32_t cached = 0, len = 0, evicted = 0, ids[4];
    CHECK_STATUS(kva_kv_seq_allocate(kv, 16, &key, 1, NULL, 0, 0, 0, &seq, &cached), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_kv_seq_append(kv, forked.seq, 1, &copy), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_kv_seq_free(kv, forked.seq), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_kv_block_take(kv, 1, 0, ids), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_kv_evict(kv, 1, &evicted), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_kv_trim(kv, &len), KVA_ERR_BACKEND);
    kva_kv_stats kst;
    CHECK_STATUS(kva_kv_get_stats(kv, &kst), KVA_OK);
    CHECK(kst.sequences == 1 && kst.used_blocks == 2);
    const uint32_t *table = NULL;
    CHECK_STATUS(kva_kv_seq_block_table(kv, forked.seq, &table, &len), KVA_OK);
    CHECK(len == 2 && table != NULL);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);
    /* So is the variable-size pool over it. */
    CHECK_STATUS(kva_var_alloc(forked.var, 4096, &p), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_var_free(forked.var, forked.range), KVA_ERR_BACKEND);
    CHECK_STATUS(kva_var_alloc(forked.var, 0, &p), KVA_ERR_INVALID); /* bad input stays bad input */
    CHECK(kva_var_usable_size(forked.var, forked.range) == 8192);
    CHECK_STATUS(kva_var_check(forked.var), KVA_OK);
    kva_pool_destroy(pool); /* unmaps this process's view only */
    return CHECK_DONE();
}

static void test_forked_child(void) {
    kva_pool *pool = forked.shared = small_pages_pool(8 * MiB, 1);
    forked.private_pool = small_pages_pool(8 * MiB, 0);
    for (int i = 0; i < 4; i++) CHECK_STATUS(kva_alloc(pool, 64, &forked.objects[i]), KVA_OK);
    CHECK_STATUS(kva_free(pool, forked.objects[3]), KVA_OK);
    CHECK_STATUS(kva_alloc(pool, MiB, (void **)&forked.block), KVA_OK);
    memset(forked.block, 0x5a, MiB);
    kva_kv_config kcfg;
    kva_kv_config_init(&kcfg);
    kcfg.num_blocks = 8; /* of 16 tokens (the default), one layer of one head of 8 */
    kcfg.layers = kcfg.kv_heads = 1;
    kcfg.head_dim = 8;
    REQUIRE(kva_kv_create(&kcfg, pool, &forked.kv) == KVA_OK);
    uint32_t cached = 0;
    CHECK_STATUS(kva_kv_seq_allocate(forked.kv, 20, NULL, 0, NULL, 0, 0, 0, &forked.seq, &cached), KVA_OK);
    kva_var_config vcfg;
    kva_var_config_init(&vcfg);
    vcfg.capacity = MiB;
    REQUIRE(kva_var_create(&vcfg, pool, &forked.var) == KVA_OK);
    CHECK_STATUS(kva_var_alloc(forked.var, 8192, &forked.range), KVA_OK);
    in_child(forked_child, "test_forked_child");
    /* The owner's block is whole, and its allocator goes on as before. */
    int whole = 1;
    for (size_t i = 0; i < MiB; i++) whole &= forked.block[i] == 0x5a;
    CHECK(whole);
    void *p = NULL;
    CHECK_STATUS(kva_alloc(pool, 64, &p), KVA_OK);
    CHECK_STATUS(kva_free(pool, p), KVA_OK);
    for (int i = 0; i < 3; i++) CHECK_STATUS(kva_free(pool, forked.objects[i]), KVA_OK);
    CHECK_STATUS(kva_free(pool, forked.block), KVA_OK);
    kva_kv_copy copy;
    CHECK_STATUS(kva_kv_seq_append(forked.kv, forked.seq, 1, &copy), KVA_OK); /* the owner's cache goes on */
    CHECK_STATUS(kva_kv_seq_free(forked.kv, forked.seq), KVA_OK);
    CHECK_STATUS(kva_kv_check(forked.kv), KVA_OK);
    kva_kv_destroy(forked.kv);
    void *another = NULL;
    CHECK_STATUS(kva_var_alloc(forked.var, 4096, &another), KVA_OK); /* and its variable-size pool */
    CHECK_STATUS(kva_var_free(forked.var, another), KVA_OK);
    CHECK_STATUS(kva_var_free(forked.var, forked.range), KVA_OK);
    CHECK_STATUS(kva_var_check(forked.var), KVA_OK);
    kva_var_destroy(forked.var);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    kva_pool_destroy(pool);
    kva_pool_destroy(forked.private_pool);
}

static int open_fds(void) {
    int n = 0;
    for (int fd = 0; fd < 1024; fd++) n += fcntl(fd, F_GETFD) >= 0;
    return n;
}

static void expect_not_pool(int fd, const char *what) {
    kva_shared_map *map = (kva_shared_map *)&fd; /* must stay as it is */
    kva_status st = kva_shared_attach(fd, &map);
    if (st != KVA_ERR_INVALID || map != (kva_shared_map *)&fd) {
        fprintf(stderr, "attach to %s: expected KVA_ERR_INVALID, got %d (%s)\n", what, (int)st, kva_last_error());
        check_failures++;
    }
}

static void test_not_a_pool(void) {
    expect_not_pool(-1, "a negative descriptor");
    expect_not_pool(1000, "a closed descriptor");
    int pipes[2];
    REQUIRE(pipe(pipes) == 0);
    expect_not_pool(pipes[0], "a pipe");
    close(pipes[0]);
    close(pipes[1]);
    char path[] = "/tmp/kva-test-shared-XXXXXX";
    int file = mkstemp(path);
    REQUIRE(file >= 0);
    unlink(path);
    REQUIRE(ftruncate(file, 1 << 20) == 0);
    expect_not_pool(file, "a regular file");
    close(file);
    /* A memfd of another name, or of the pool's name without the pool's seals. */
    int other = memfd_create("not-kvalloc", MFD_ALLOW_SEALING);
    REQUIRE(other >= 0 && ftruncate(other, 1 << 20) == 0);
    REQUIRE(fcntl(other, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) == 0);
    expect_not_pool(other, "a memfd of another name");
    close(other);
    int unsealed = memfd_create(KVA_OS_SHARED_NAME, MFD_ALLOW_SEALING);
    REQUIRE(unsealed >= 0 && ftruncate(unsealed, 1 << 20) == 0);
    expect_not_pool(unsealed, "an unsealed memfd of the pool's name");
    close(unsealed);
    CHECK_STATUS(kva_shared_attach(3, NULL), KVA_ERR_INVALID);
    expect_not_pool(INT32_MAX, "the largest descriptor");
    int devzero = open("/dev/zero", O_RDWR);
    REQUIRE(devzero >= 0);
    expect_not_pool(devzero, "/dev/zero");
    close(devzero);
    int sock[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sock) == 0);
    expect_not_pool(sock[0], "a socket");
    close(sock[0]);
    close(sock[1]);
    /* The pool's name and seals, but also a seal the pool never has: not a pool. */
    int write_sealed = memfd_create(KVA_OS_SHARED_NAME, MFD_ALLOW_SEALING);
    REQUIRE(write_sealed >= 0 && ftruncate(write_sealed, 1 << 20) == 0);
    REQUIRE(fcntl(write_sealed, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_WRITE | F_SEAL_SEAL) == 0);
    expect_not_pool(write_sealed, "a memfd of the pool's name sealed against writes");
    close(write_sealed);

    /* A pool's own object, reopened read-only or write-only through /proc: the map would be
     * read-write, so it is refused as the caller's mistake. Its owner gone, the descriptor
     * still maps the object. */
    kva_config scfg;
    kva_config_init(&scfg);
    scfg.capacity = 4 * MiB;
    scfg.shared = 1;
    scfg.pages = KVA_PAGES_SMALL;
    kva_pool *shared = NULL;
    CHECK_STATUS(kva_pool_create(&scfg, &shared), KVA_OK);
    REQUIRE(shared);
    int pool_fd = -1;
    CHECK_STATUS(kva_pool_shared_fd(shared, &pool_fd), KVA_OK);
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", pool_fd);
    int read_only = open(link, O_RDONLY | O_CLOEXEC), write_only = open(link, O_WRONLY | O_CLOEXEC);
    REQUIRE(read_only >= 0 && write_only >= 0);
    expect_not_pool(read_only, "a pool's object opened read-only");
    expect_not_pool(write_only, "a pool's object opened write-only");
    close(read_only);
    close(write_only);
    kva_pool_destroy(shared);
    kva_shared_map *orphan = NULL;
    CHECK_STATUS(kva_shared_attach(pool_fd, &orphan), KVA_OK);
    CHECK(orphan && kva_shared_length(orphan) >= 4 * MiB);
    kva_shared_detach(orphan);
    close(pool_fd);

    /* A pool that is not shared has no descriptor; the call changes nothing. */
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = 4 * MiB;
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    REQUIRE(pool);
    void *p = NULL;
    CHECK_STATUS(kva_alloc(pool, 4096, &p), KVA_OK);
    snapshot before = take(pool);
    int fd = 12345;
    CHECK_STATUS(kva_pool_shared_fd(pool, &fd), KVA_ERR_INVALID);
    CHECK(fd == 12345);
    CHECK(unchanged(pool, &before));
    CHECK_STATUS(kva_pool_shared_fd(pool, NULL), KVA_ERR_INVALID);
    CHECK_STATUS(kva_pool_shared_fd(NULL, &fd), KVA_ERR_INVALID);
    kva_pool_destroy(pool);
}

static void test_pages_and_options(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = 8 * MiB;
    cfg.shared = 1;
    /* hugetlb: where the machine reserves none, the refusal is the backend's. */
    cfg.pages = KVA_PAGES_HUGETLB;
    kva_pool *pool = NULL;
    kva_status st = kva_pool_create(&cfg, &pool);
    CHECK(st == KVA_OK || st == KVA_ERR_BACKEND);
    if (st == KVA_OK) {
        kva_stats s;
        kva_get_stats(pool, &s);
        CHECK(s.page_kind == KVA_PAGE_KIND_HUGETLB);
        kva_pool_destroy(pool);
    }
    /* Transparent huge pages follow shmem's own setting. */
    cfg.pages = KVA_PAGES_THP;
    pool = NULL;
    st = kva_pool_create(&cfg, &pool);
    CHECK(st == (kva_os_shmem_thp_unavailable() ? KVA_ERR_BACKEND : KVA_OK));
    kva_pool_destroy(pool);
    /* Automatic: some kind always works, and prefault and lock apply to the shared pages. */
    cfg.pages = KVA_PAGES_AUTO;
    cfg.prefault = 1;
    pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    if (pool) {
        kva_stats s;
        kva_get_stats(pool, &s);
        CHECK(s.page_kind != KVA_PAGE_KIND_EXTERNAL && s.page_kind != KVA_PAGE_KIND_DEVICE);
        CHECK_STATUS(kva_check(pool), KVA_OK);
        kva_pool_destroy(pool);
    }

    /* The memfd refused, or its mapping: the pool is refused and nothing stays open. */
    cfg.prefault = 0;
    cfg.pages = KVA_PAGES_SMALL;
    int before = open_fds();
    for (unsigned nth = 1; nth <= 2; nth++) {
        kva_os_fail_nth(KVA_OS_SHARED, nth, ENOMEM);
        pool = NULL;
        CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_BACKEND);
        CHECK(pool == NULL);
        CHECK(kva_os_fail_nth(KVA_OS_ANY, 0, 0) == 0); /* it fired */
    }
    CHECK(open_fds() == before);
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--attach") == 0) return attacher(atoi(argv[2]));
    hang_guard("test_shared", HANG_GUARD_SECONDS);
    test_two_processes("/proc/self/exe");
    test_map_outlives_pool();
    test_range_release();
    test_forked_child();
    test_not_a_pool();
    test_pages_and_options();
    return CHECK_DONE();
}
