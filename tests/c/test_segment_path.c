/*
 * test_segment_path.c — whatever sits at the path of a named pool's statistics segment before the
 * pool is created. /dev/shm is world-writable and the name kvalloc.<pid>.<name> is predictable,
 * so anyone on the machine may put something there. Only this library's own abandoned segment
 * is replaced: a regular file of this user, mode 0600, holding a segment header of this process
 * and of the file's size, whose writer holds no liveness lock. Anything else is refused with
 * KVA_ERR_BACKEND, a message naming the path and what was found, and is left exactly as it was
 * (same inode, type, owner, mode, times and contents; a symbolic link's target too). An alarm
 * turns a creation that waits forever (a FIFO opened for reading waits for a writer) into a
 * failure of this test.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "check.h"
#include "kv_test.h"
#include "kvalloc.h"
#include "kvalloc_stats.h"

#define NOBODY 65534 /* the owner of the file another user left */
#define ALARM_SECONDS 60

/* The case under way and what it planted, for the alarm's report and cleanup. */
static char current_case[96], current_path[160];

static void on_alarm(int sig) {
    (void)sig;
    static const char what[] = "hung: test_segment_path: creation did not return within the alarm: ";
    if (write(2, what, sizeof what - 1) < 0 || write(2, current_case, strlen(current_case)) < 0 ||
        write(2, "\n", 1) < 0)
        _exit(1);
    unlink(current_path);
    _exit(1);
}

static void path_of(const char *name, char *path, size_t size) {
    snprintf(path, size, "/dev/shm/%s%d.%s", KVA_SHM_PREFIX, (int)getpid(), name);
}

/* Arms the alarm for one creation. */
static void start_case(const char *what, const char *path) {
    snprintf(current_case, sizeof current_case, "%s", what);
    snprintf(current_path, sizeof current_path, "%s", path);
    alarm(ALARM_SECONDS);
}

/* What is at a path, as far as the test can tell without opening a FIFO or a device. */
typedef struct found {
    int exists;
    struct stat st;
    char link[256];           /* a symbolic link's target */
    unsigned char head[8192]; /* a regular file's first bytes */
    ssize_t head_len;
} found;

static found look(const char *path) {
    found f;
    memset(&f, 0, sizeof f);
    if (lstat(path, &f.st) != 0) return f;
    f.exists = 1;
    if (S_ISLNK(f.st.st_mode)) REQUIRE(readlink(path, f.link, sizeof f.link - 1) >= 0);
    if (S_ISREG(f.st.st_mode)) {
        int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        REQUIRE(fd >= 0);
        f.head_len = pread(fd, f.head, sizeof f.head, 0);
        REQUIRE(f.head_len >= 0);
        close(fd);
    }
    return f;
}

static int same_time(struct timespec a, struct timespec b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; }

static int unchanged(const found *before, const found *after) {
    const struct stat *a = &before->st, *b = &after->st;
    return after->exists && a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_mode == b->st_mode &&
           a->st_uid == b->st_uid && a->st_nlink == b->st_nlink && a->st_size == b->st_size &&
           a->st_rdev == b->st_rdev && same_time(a->st_mtim, b->st_mtim) && same_time(a->st_ctim, b->st_ctim) &&
           strcmp(before->link, after->link) == 0 && before->head_len == after->head_len &&
           memcmp(before->head, after->head, (size_t)before->head_len) == 0;
}

static kva_config named_config(const char *name) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)32 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.name = name;
    return cfg;
}

/* Creates a pool named `name` over whatever is at its segment path, and checks that it is
 * refused with `expected` and a message naming the path and `phrase`, and that the thing at
 * the path, and at `also` when given (a link's target, or where a dangling one points), is
 * unchanged. */
static void expect_refused(const char *what, const char *name, kva_status expected, const char *phrase,
                           const char *also) {
    char path[160];
    path_of(name, path, sizeof path);
    found before = look(path), also_before = also ? look(also) : (found){0};
    REQUIRE(before.exists);
    kva_config cfg = named_config(name);
    kva_pool *pool = (kva_pool *)0x5e;
    start_case(what, path);
    kva_status st = kva_pool_create(&cfg, &pool);
    alarm(0);
    const char *msg = kva_last_error();
    int says = strstr(msg, path) != NULL && strstr(msg, phrase) != NULL;
    if (st != expected || pool != (kva_pool *)0x5e || !says) {
        fprintf(stderr, "%s: status %d (expected %d), message \"%s\" (expected to name %s and \"%s\")\n", what, (int)st,
                (int)expected, msg, path, phrase);
        check_failures++;
    }
    if (st == KVA_OK && pool != (kva_pool *)0x5e) kva_pool_destroy(pool);
    found after = look(path);
    if (!unchanged(&before, &after)) {
        fprintf(stderr, "%s: %s was %s\n", what, path, after.exists ? "changed" : "removed");
        check_failures++;
    }
    if (also) {
        found also_after = look(also);
        if (also_before.exists ? !unchanged(&also_before, &also_after) : also_after.exists) {
            fprintf(stderr, "%s: the link's target %s was %s\n", what, also,
                    !also_before.exists ? "created"
                    : also_after.exists ? "changed"
                                        : "removed");
            check_failures++;
        }
    }
}

/* The segment of a pool named `name` as the pool left it, copied out while the pool lived. */
typedef struct leftover {
    unsigned char *bytes;
    size_t size;
} leftover;

static leftover real_segment(const char *name) {
    kva_config cfg = named_config(name);
    kva_pool *pool = NULL;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    char path[160];
    path_of(name, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    REQUIRE(fd >= 0 && fstat(fd, &st) == 0);
    leftover l = {malloc((size_t)st.st_size), (size_t)st.st_size};
    REQUIRE(l.bytes && pread(fd, l.bytes, l.size, 0) == (ssize_t)l.size);
    close(fd);
    kva_pool_destroy(pool);
    return l;
}

/* Writes bytes as a new file at path, of mode `mode` (umask aside). */
static void plant_file(const char *path, const void *bytes, size_t size, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(size == 0 || write(fd, bytes, size) == (ssize_t)size);
    REQUIRE(fchmod(fd, mode) == 0);
    close(fd);
}

static void plant_leftover(const char *name, const leftover *l, mode_t mode) {
    char path[160];
    path_of(name, path, sizeof path);
    plant_file(path, l->bytes, l->size, mode);
}

static void remove_at(const char *name) {
    char path[160];
    path_of(name, path, sizeof path);
    struct stat st;
    if (lstat(path, &st) != 0) return;
    REQUIRE((S_ISDIR(st.st_mode) ? rmdir(path) : unlink(path)) == 0);
}

/* The control: this process's own abandoned segment is replaced by the new pool's, whose
 * writer holds the liveness lock. */
static void test_own_leftover_is_replaced(const leftover *l) {
    plant_leftover("leftover", l, 0600);
    char path[160];
    path_of("leftover", path, sizeof path);
    kva_config cfg = named_config("leftover");
    kva_pool *pool = NULL;
    start_case("own leftover", path);
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    alarm(0);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    CHECK(fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK);
    close(fd);
    if (pool) kva_pool_destroy(pool);
    struct stat st;
    CHECK(lstat(path, &st) != 0);
}

/* Regular files that are not this process's abandoned segment, though most come close. */
static void test_regular_files(const leftover *l) {
    char path[160];

    plant_leftover("mode644", l, 0644);
    expect_refused("a leftover of mode 0644", "mode644", KVA_ERR_BACKEND, "mode 0644", NULL);
    remove_at("mode644");
    plant_leftover("mode666", l, 0666);
    expect_refused("a leftover of mode 0666", "mode666", KVA_ERR_BACKEND, "mode 0666", NULL);
    remove_at("mode666");

    if (geteuid() == 0) {
        plant_leftover("nobody", l, 0600);
        path_of("nobody", path, sizeof path);
        REQUIRE(chown(path, NOBODY, NOBODY) == 0);
        expect_refused("a leftover of another owner", "nobody", KVA_ERR_BACKEND, "owned by uid 65534", NULL);
        remove_at("nobody");
    } else {
        fprintf(stderr, "test_segment_path: the file of another owner is skipped (needs root to chown)\n");
    }

    unsigned char *copy = malloc(l->size);
    REQUIRE(copy);
    memcpy(copy, l->bytes, l->size);
    copy[0] ^= 0xff; /* the magic */
    path_of("badmagic", path, sizeof path);
    plant_file(path, copy, l->size, 0600);
    expect_refused("a leftover without the magic", "badmagic", KVA_ERR_BACKEND, "magic", NULL);
    remove_at("badmagic");

    memcpy(copy, l->bytes, l->size);
    ((kva_shm_header *)copy)->writer_pid = (uint32_t)getpid() + 1;
    path_of("otherpid", path, sizeof path);
    plant_file(path, copy, l->size, 0600);
    expect_refused("a segment of another writer", "otherpid", KVA_ERR_BACKEND, "pid", NULL);
    remove_at("otherpid");
    free(copy);

    srand(20);
    unsigned char noise[4096];
    for (size_t i = 0; i < sizeof noise; i++) noise[i] = (unsigned char)rand();
    path_of("noise", path, sizeof path);
    plant_file(path, noise, sizeof noise, 0600);
    expect_refused("a file of random bytes", "noise", KVA_ERR_BACKEND, "magic", NULL);
    remove_at("noise");

    path_of("empty", path, sizeof path);
    plant_file(path, NULL, 0, 0600);
    expect_refused("an empty file", "empty", KVA_ERR_BACKEND, "0 bytes", NULL);
    remove_at("empty");

    /* Huge and sparse: one terabyte of holes, nothing of it read. */
    path_of("sparse", path, sizeof path);
    plant_file(path, NULL, 0, 0600);
    REQUIRE(truncate(path, (off_t)1 << 40) == 0);
    expect_refused("a huge sparse file", "sparse", KVA_ERR_BACKEND, "magic", NULL);
    remove_at("sparse");

    /* A real segment's header in a file of another size. */
    plant_leftover("grown", l, 0600);
    path_of("grown", path, sizeof path);
    REQUIRE(truncate(path, (off_t)1 << 40) == 0);
    expect_refused("a leftover grown to a terabyte", "grown", KVA_ERR_BACKEND, "bytes", NULL);
    remove_at("grown");
}

/* A symbolic link named `name` to target: refused, and both left as they are. */
static void expect_link_refused(const char *what, const char *name, const char *target) {
    char path[160];
    path_of(name, path, sizeof path);
    REQUIRE(symlink(target, path) == 0);
    expect_refused(what, name, KVA_ERR_BACKEND, "is a symbolic link", target);
    remove_at(name);
}

static void test_other_kinds(const leftover *l) {
    char path[160], target[160];

    path_of("dir", path, sizeof path);
    REQUIRE(mkdir(path, 0700) == 0);
    expect_refused("a directory", "dir", KVA_ERR_BACKEND, "is a directory", NULL);
    remove_at("dir");

    path_of("sock", path, sizeof path);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    REQUIRE(strlen(path) < sizeof addr.sun_path);
    memcpy(addr.sun_path, path, strlen(path) + 1);
    REQUIRE(sock >= 0 && bind(sock, (struct sockaddr *)&addr, sizeof addr) == 0 && listen(sock, 1) == 0);
    expect_refused("a listening socket", "sock", KVA_ERR_BACKEND, "is a socket", NULL);
    close(sock);
    remove_at("sock");

    path_of("null", path, sizeof path);
    if (mknod(path, S_IFCHR | 0600, makedev(1, 3)) == 0) {
        expect_refused("a character device node", "null", KVA_ERR_BACKEND, "is a character device", NULL);
        remove_at("null");
    } else {
        fprintf(stderr, "test_segment_path: the device node is skipped (mknod: %s)\n", strerror(errno));
    }

    /* Links: to this process's own abandoned segment under another name (which following the
     * link would replace), to nothing, and to a FIFO (which following the link would wait on). */
    path_of("target", target, sizeof target);
    plant_leftover("target", l, 0600);
    expect_link_refused("a symbolic link to a leftover", "link", target);
    remove_at("target");
    path_of("nothing", target, sizeof target);
    expect_link_refused("a dangling symbolic link", "dangling", target);
    path_of("fifotarget", target, sizeof target);
    REQUIRE(mkfifo(target, 0600) == 0);
    expect_link_refused("a symbolic link to a FIFO", "fifolink", target);
    remove_at("fifotarget");

    /* Last, so that a library that waits on it has reported every case above first. */
    path_of("fifo", path, sizeof path);
    REQUIRE(mkfifo(path, 0600) == 0);
    expect_refused("a FIFO", "fifo", KVA_ERR_BACKEND, "is a FIFO", NULL);
    remove_at("fifo");
}

/* A KV cache that creates its own pool meets the path the same way. */
static void test_kv_cache_over_a_fifo(void) {
    char path[160];
    path_of("kvfifo", path, sizeof path);
    REQUIRE(mkfifo(path, 0600) == 0);
    kva_kv_config cfg = small_config(64, 16);
    cfg.name = "kvfifo";
    kva_kv *kv = SENTINEL_KV;
    start_case("a KV cache over a FIFO", path);
    CHECK_STATUS(kva_kv_create(&cfg, NULL, &kv), KVA_ERR_BACKEND);
    alarm(0);
    CHECK(kv == SENTINEL_KV && strstr(kva_last_error(), "is a FIFO") != NULL);
    struct stat st;
    CHECK(lstat(path, &st) == 0 && S_ISFIFO(st.st_mode));
    remove_at("kvfifo");
}

int main(void) {
    signal(SIGALRM, on_alarm);
    leftover l = real_segment("original");
    test_own_leftover_is_replaced(&l);
    test_regular_files(&l);
    test_other_kinds(&l);
    test_kv_cache_over_a_fifo();
    free(l.bytes);
    return CHECK_DONE();
}
