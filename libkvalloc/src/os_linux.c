/*
 * os_linux.c — the Linux implementation of os.h.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "os.h"

#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif
#ifndef MAP_HUGE_2MB
#define MAP_HUGE_2MB (21 << MAP_HUGE_SHIFT)
#endif
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB MAP_HUGE_2MB /* the memfd flag is the mmap one (linux/memfd.h) */
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* The armed failure of this thread (see kva_os_fail_nth); countdown 0: none. */
static _Thread_local struct {
    kva_os_call call;
    unsigned countdown;
    int error;
} injected;

unsigned kva_os_fail_nth(kva_os_call call, unsigned n, int error) {
    unsigned left = injected.countdown;
    injected.call = call;
    injected.countdown = n;
    injected.error = error;
    return left;
}

/* Whether this call is the one armed to fail; if so errno is set as the kernel would. */
static int fails_now(kva_os_call call) {
    if (kva_likely(injected.countdown == 0)) return 0;
    if (injected.call != KVA_OS_ANY && injected.call != call) return 0;
    if (--injected.countdown != 0) return 0;
    errno = injected.error;
    return 1;
}

kva_status kva_os_discard(void *addr, size_t length) {
    if (madvise(addr, length, MADV_DONTNEED) != 0)
        return kva_fail(KVA_ERR_BACKEND, "madvise(MADV_DONTNEED) of %zu bytes: %s", length, strerror(errno));
    return KVA_OK;
}

kva_status kva_os_discard_shared(void *addr, size_t length) {
    if (madvise(addr, length, MADV_REMOVE) != 0)
        return kva_fail(KVA_ERR_BACKEND, "madvise(MADV_REMOVE) of %zu bytes: %s", length, strerror(errno));
    return KVA_OK;
}

size_t kva_os_page_size(void) {
    long size = sysconf(_SC_PAGESIZE);
    return size > 0 ? (size_t)size : 4096;
}

/* The start of a small kernel file, NUL-terminated in text; 0 if it cannot be read or is empty. */
static int read_text(const char *path, char *text, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return 0;
    ssize_t n = read(fd, text, size - 1);
    close(fd);
    if (n <= 0) return 0;
    text[n] = '\0';
    return 1;
}

/* The first unsigned number in the file after `key` (the whole file when key is ""), times
 * unit; SIZE_MAX where the file, the key or the number is missing ("max" included). */
static size_t read_number(const char *path, const char *key, size_t unit) {
    char text[4096];
    if (!read_text(path, text, sizeof text)) return SIZE_MAX;
    const char *at = key[0] ? strstr(text, key) : text;
    if (!at) return SIZE_MAX;
    at += strlen(key);
    while (*at == ' ' || *at == '\t') at++;
    if (*at < '0' || *at > '9') return SIZE_MAX;
    errno = 0;
    unsigned long long value = strtoull(at, NULL, 10);
    if (errno || value > SIZE_MAX / unit) return SIZE_MAX;
    return (size_t)value * unit;
}

/* Room left under the memory cgroup of this process: limit less usage; SIZE_MAX when it has
 * no limit or it cannot be read. */
static size_t cgroup_room(void) {
    char cgroups[4096], path[4352];
    if (!read_text("/proc/self/cgroup", cgroups, sizeof cgroups)) return SIZE_MAX;
    size_t room = SIZE_MAX;
    char *save = NULL;
    for (char *line = strtok_r(cgroups, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *rest = strchr(line, ':'), *dir;
        if (!rest || !(dir = strchr(rest + 1, ':'))) continue;
        *dir++ = '\0';
        const char *controllers = rest + 1;
        size_t limit = SIZE_MAX, usage = SIZE_MAX;
        if (controllers[0] == '\0') { /* v2: 0::/path */
            snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.max", dir);
            limit = read_number(path, "", 1);
            snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.current", dir);
            usage = read_number(path, "", 1);
        } else if (strstr(controllers, "memory")) { /* v1: N:memory:/path */
            snprintf(path, sizeof path, "/sys/fs/cgroup/memory%s/memory.limit_in_bytes", dir);
            limit = read_number(path, "", 1);
            snprintf(path, sizeof path, "/sys/fs/cgroup/memory%s/memory.usage_in_bytes", dir);
            usage = read_number(path, "", 1);
        }
        if (limit == SIZE_MAX) continue;
        size_t left = usage == SIZE_MAX ? limit : (usage < limit ? limit - usage : 0);
        if (left < room) room = left;
    }
    return room;
}

size_t kva_os_available_memory(void) {
    size_t least = read_number("/proc/meminfo", "MemAvailable:", 1024);
    long pages = sysconf(_SC_PHYS_PAGES);
    if (pages > 0 && (size_t)pages * kva_os_page_size() < least) least = (size_t)pages * kva_os_page_size();
    size_t room = cgroup_room();
    if (room < least) least = room;
    return least == SIZE_MAX ? 0 : least;
}

kva_status kva_os_reserve(size_t length, size_t alignment, void **out) {
    /* Over-reserve by the alignment, then trim both ends: the kernel only promises page
     * alignment, and buddy blocks must be aligned to their size in absolute addresses. */
    size_t span = length + alignment;
    if (span < length) return kva_fail(KVA_ERR_INVALID, "reservation of %zu bytes overflows", length);
    void *raw = fails_now(KVA_OS_RESERVE)
                    ? MAP_FAILED
                    : mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return kva_fail(KVA_ERR_BACKEND, "mmap reserve of %zu bytes: %s", span, strerror(errno));
    uintptr_t start = (uintptr_t)raw;
    uintptr_t aligned = (start + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (aligned > start) munmap(raw, aligned - start);
    uintptr_t end = aligned + length;
    if (start + span > end) munmap((void *)end, start + span - end);
    *out = (void *)aligned;
    return KVA_OK;
}

kva_status kva_os_commit(void *addr, size_t length, kva_os_backing backing) {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, huge = backing == KVA_OS_HUGETLB;
    if (huge) flags |= MAP_HUGETLB | MAP_HUGE_2MB; /* reserved up front: their failure is early */
    else if (backing == KVA_OS_LAZY) flags |= MAP_NORESERVE;
    void *p = fails_now(huge ? KVA_OS_COMMIT_HUGE : KVA_OS_COMMIT)
                  ? MAP_FAILED
                  : mmap(addr, length, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        /* What an accounted mapping's refusal means: the kernel cannot back it now. */
        kva_status st = backing == KVA_OS_CHARGED && err == ENOMEM ? KVA_ERR_NOMEM : KVA_ERR_BACKEND;
        return kva_fail(st, "mmap%s of %zu bytes%s: %s", huge ? " MAP_HUGETLB" : "", length,
                        backing == KVA_OS_CHARGED ? ", all of them to be touched (prefault, lock or pin)" : "",
                        strerror(err));
    }
    return KVA_OK;
}

/* The bracketed choice of a transparent_hugepage "enabled" file ("always [madvise] never"), or
 * NULL if the file cannot be read. */
static const char *thp_setting(const char *path, char *line, size_t size) {
    FILE *f = fopen(path, "re");
    if (!f) return NULL;
    const char *chosen = fgets(line, (int)size, f) ? strchr(line, '[') : NULL;
    fclose(f);
    return chosen;
}

/* madvise(MADV_HUGEPAGE) succeeds all the same in each case kva_os_thp_unavailable names, so
 * only asking tells. */
const char *kva_os_thp_unavailable(void) {
    /* PR_GET_THP_DISABLE gives 1 when disabled outright; with PR_THP_DISABLE_EXCEPT_ADVISED
     * (bit 1, Linux 6.18) advised ranges still get them. */
    int disabled = prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0);
    if (disabled > 0 && !(disabled & (1 << 1))) return "disabled for this process (prctl PR_SET_THP_DISABLE)";
    /* The 2 MiB size's own setting, where the kernel has per-size ones (6.8), overrides the
     * global one unless it says inherit. */
    char line[128];
    const char *size_setting = thp_setting("/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/enabled", line,
                                           sizeof line);
    if (size_setting && strncmp(size_setting, "[inherit]", 9) != 0)
        return strncmp(size_setting, "[never]", 7) == 0
                   ? "disabled for 2 MiB pages (/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/enabled)"
                   : NULL;
    const char *setting = thp_setting("/sys/kernel/mm/transparent_hugepage/enabled", line, sizeof line);
    if (setting && strncmp(setting, "[never]", 7) == 0)
        return "disabled system-wide (/sys/kernel/mm/transparent_hugepage/enabled is never)";
    return NULL;
}

kva_status kva_os_advise_thp(void *addr, size_t length) {
    if (fails_now(KVA_OS_ADVISE) || madvise(addr, length, MADV_HUGEPAGE) != 0)
        return kva_fail(KVA_ERR_BACKEND, "transparent huge pages refused: madvise(MADV_HUGEPAGE): %s", strerror(errno));
    const char *why = kva_os_thp_unavailable();
    if (why) return kva_fail(KVA_ERR_BACKEND, "transparent huge pages are %s", why);
    return KVA_OK;
}

kva_status kva_os_populate(void *addr, size_t length) {
    if (!fails_now(KVA_OS_POPULATE) && madvise(addr, length, MADV_POPULATE_WRITE) == 0) return KVA_OK;
    if (errno != EINVAL) return kva_fail(KVA_ERR_BACKEND, "madvise(MADV_POPULATE_WRITE): %s", strerror(errno));
    /* Kernels before 5.14 lack MADV_POPULATE_WRITE: touch one byte per base page instead. Not
     * per huge page: a transparent huge page fault that finds no free huge page falls back to
     * one base page, and the rest of the 2 MiB would stay untouched. The touch adds zero
     * atomically, a write fault that keeps the byte: metadata is populated after its first
     * records are written, and a block taken back (kva_pool_range_take) is its caller's, whose
     * threads may be writing to it. */
    size_t step = kva_os_page_size();
    unsigned char *bytes = addr;
    for (size_t off = 0; off < length; off += step) __atomic_fetch_add(&bytes[off], 0, __ATOMIC_RELAXED);
    return KVA_OK;
}

kva_status kva_os_map_metadata(size_t length, void **out) {
    /* MAP_NORESERVE for the reason kva_os_commit gives: the metadata of a pool sized for the
     * worst case is mostly never touched (slab bitmaps alone are about 2% of the capacity), and
     * without it the overcommit heuristic refuses the metadata of a region it accepts (a pool
     * above about 1 TiB on a machine of 24 GiB). */
    void *p = fails_now(KVA_OS_METADATA)
                  ? MAP_FAILED
                  : mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        return kva_fail(err == ENOMEM ? KVA_ERR_NOMEM : KVA_ERR_BACKEND, "mmap of %zu metadata bytes: %s", length,
                        strerror(err));
    }
    *out = p;
    return KVA_OK;
}

void kva_os_unmap(void *addr, size_t length) {
    if (addr && length) munmap(addr, length);
}

#define SHM_DIR "/dev/shm" /* where shm_open puts the object "/<leaf>" */

/* What a file of this mode is, for a message. */
static const char *file_kind(mode_t mode) {
    switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    }
    return "a file of unknown type";
}

static int same_file(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

static kva_status left_alone(const char *path, const char *what) {
    return kva_fail(KVA_ERR_BACKEND, "%s is %s: not an abandoned segment of this process, left as it is", path, what);
}

/* What is at `leaf` of SHM_DIR (dir): KVA_OK with *fd_out -1 if nothing is there, or with
 * *fd_out open on this process's abandoned object and its liveness lock held exclusively;
 * otherwise the refusal naming what is there.
 *
 * The name is predictable and SHM_DIR world-writable, so anyone may have put there a FIFO
 * (which an open for reading waits on), a link (to a file its maker could not touch), a device.
 * The first look is through an O_PATH descriptor, which opens nothing; only a regular file is
 * then opened, without following a link or blocking, and only if it is the file looked at. */
static kva_status inspect_leftover(int dir, const char *leaf, const char *path, kva_os_shm_own_fn own, int *fd_out) {
    *fd_out = -1;
    struct stat seen, opened;
    int probe = openat(dir, leaf, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (probe < 0)
        return errno == ENOENT ? KVA_OK : kva_fail(KVA_ERR_BACKEND, "looking at %s: %s", path, strerror(errno));
    int err = fstat(probe, &seen) == 0 ? 0 : errno;
    close(probe);
    if (err) return kva_fail(KVA_ERR_BACKEND, "fstat of %s: %s", path, strerror(err));
    char what[128];
    if (!S_ISREG(seen.st_mode)) return left_alone(path, file_kind(seen.st_mode));
    if (seen.st_uid != geteuid()) {
        snprintf(what, sizeof what, "a file owned by uid %u", (unsigned)seen.st_uid);
        return left_alone(path, what);
    }
    if ((seen.st_mode & 07777) != 0600) {
        snprintf(what, sizeof what, "a file of mode %04o", (unsigned)(seen.st_mode & 07777));
        return left_alone(path, what);
    }
    int fd = openat(dir, leaf, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? KVA_OK : kva_fail(KVA_ERR_BACKEND, "opening %s: %s", path, strerror(errno));
    if (fstat(fd, &opened) != 0 || !same_file(&seen, &opened)) {
        close(fd);
        return kva_fail(KVA_ERR_BACKEND, "%s changed while it was looked at: left as it is", path);
    }
    /* A reader testing liveness holds the exclusive lock of an abandoned object for a moment
     * too (kvalloc ls, top): a few tries, a millisecond apart, tell it from a live writer. */
    int abandoned = 0;
    for (int tries = 0; tries < 5 && !abandoned; tries++) {
        if (tries) nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
        abandoned = flock(fd, LOCK_EX | LOCK_NB) == 0;
    }
    if (!abandoned) {
        close(fd);
        return kva_fail(KVA_ERR_INVALID, "%s is published by a live pool: names must differ among a process's pools",
                        path);
    }
    unsigned char head[KVA_OS_SHM_HEAD];
    size_t want = (uint64_t)opened.st_size < sizeof head ? (size_t)opened.st_size : sizeof head;
    ssize_t got = pread(fd, head, want, 0);
    if (got < 0) {
        err = errno;
        close(fd);
        return kva_fail(KVA_ERR_BACKEND, "reading %s: %s", path, strerror(err));
    }
    if (!own(head, (size_t)got, (uint64_t)opened.st_size, what, sizeof what)) {
        close(fd);
        return left_alone(path, what);
    }
    *fd_out = fd;
    return KVA_OK;
}

/* Removes the object `name` if it is provably this process's abandoned one (kva_os_shm_create
 * says what that takes); KVA_OK also when nothing is there, otherwise the refusal. The unlink
 * happens with the liveness lock held and only while the name still names the file inspected.
 * SHM_DIR is sticky, so once that file is found to be this user's no other user can rename or
 * remove it in between: only another thread of this process creating a pool of the same name
 * at that moment could (a race the caller made, which would cost that pool its published
 * statistics, nothing more). */
static kva_status remove_if_abandoned(const char *name, kva_os_shm_own_fn own) {
    char path[sizeof SHM_DIR + KVA_NAME_MAX + 32];
    snprintf(path, sizeof path, "%s%s", SHM_DIR, name);
    const char *leaf = name + 1;
    int dir = open(SHM_DIR, O_PATH | O_DIRECTORY | O_CLOEXEC), fd;
    if (dir < 0) return kva_fail(KVA_ERR_BACKEND, "open(%s): %s", SHM_DIR, strerror(errno));
    kva_status st = inspect_leftover(dir, leaf, path, own, &fd);
    struct stat held, now;
    if (fd >= 0 && fstat(fd, &held) == 0 && fstatat(dir, leaf, &now, AT_SYMLINK_NOFOLLOW) == 0 &&
        same_file(&held, &now))
        unlinkat(dir, leaf, 0);
    if (fd >= 0) close(fd);
    close(dir);
    return st;
}

kva_status kva_os_shm_create(const char *name, size_t length, kva_os_shm_own_fn own, void **out, int *fd_out) {
    /* Bounded: one leftover removed, then another, then the name is given up on (something
     * else keeps taking it between the removal and the creation). */
    int fd = -1;
    for (int attempt = 0;; attempt++) {
        fd = fails_now(KVA_OS_SHM) ? -1 : shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0 || errno != EEXIST) break;
        if (attempt == 2) return kva_fail(KVA_ERR_BACKEND, "%s%s is taken again each time it is freed", SHM_DIR, name);
        kva_status st = remove_if_abandoned(name, own);
        if (st != KVA_OK) return st;
    }
    if (fd < 0) return kva_fail(KVA_ERR_BACKEND, "shm_open(%s): %s", name, strerror(errno));
    /* The pages are allocated now (posix_fallocate), not at the first write to them: a tmpfs
     * without room for them (a container's 64 MiB /dev/shm, shared) then refuses the creation,
     * where a sparse file would kill the writer with SIGBUS at that write, in the middle of
     * creating the pool or of a publish long after. */
    const char *step = "sizing";
    int err = 0;
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)length) != 0 ||
        (step = "allocating", err = posix_fallocate(fd, 0, (off_t)length)) != 0 ||
        (step = "locking", flock(fd, LOCK_SH)) != 0) {
        if (err == 0) err = errno;
        close(fd);
        shm_unlink(name);
        return kva_fail(KVA_ERR_BACKEND, "%s %s (%zu bytes): %s", step, name, length, strerror(err));
    }
    void *p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        err = errno;
        close(fd);
        shm_unlink(name);
        return kva_fail(KVA_ERR_BACKEND, "mmap of %s: %s", name, strerror(err));
    }
    *out = p;
    *fd_out = fd;
    return KVA_OK;
}

void kva_os_close(int fd) {
    if (fd >= 0) close(fd);
}

void kva_os_shm_unlink(const char *name) { shm_unlink(name); }

kva_status kva_os_shared_create(size_t length, int hugetlb, int *fd_out) {
    unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING | (hugetlb ? MFD_HUGETLB | MFD_HUGE_2MB : 0);
    int fd = fails_now(KVA_OS_SHARED) ? -1 : memfd_create(KVA_OS_SHARED_NAME, flags);
    if (fd < 0)
        return kva_fail(KVA_ERR_BACKEND, "memfd_create(%s%s): %s", KVA_OS_SHARED_NAME, hugetlb ? ", MFD_HUGETLB" : "",
                        strerror(errno));
    if (ftruncate(fd, (off_t)length) != 0) {
        int err = errno;
        close(fd);
        return kva_fail(KVA_ERR_BACKEND, "ftruncate of the shared memory object to %zu bytes: %s", length,
                        strerror(err));
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
        int err = errno;
        close(fd);
        return kva_fail(KVA_ERR_BACKEND, "sealing the shared memory object: %s", strerror(err));
    }
    *fd_out = fd;
    return KVA_OK;
}

kva_status kva_os_shared_commit(void *addr, size_t length, int fd) {
    void *p = fails_now(KVA_OS_SHARED) ? MAP_FAILED
                                       : mmap(addr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (p == MAP_FAILED)
        return kva_fail(KVA_ERR_BACKEND, "mmap MAP_SHARED of %zu bytes of the shared memory object: %s", length,
                        strerror(errno));
    return KVA_OK;
}

const char *kva_os_shmem_thp_unavailable(void) {
    int disabled = prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0);
    if (disabled > 0 && !(disabled & (1 << 1))) return "disabled for this process (prctl PR_SET_THP_DISABLE)";
    char line[128];
    const char *size_setting = thp_setting("/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled", line,
                                           sizeof line);
    const char *setting = size_setting && strncmp(size_setting, "[inherit]", 9) != 0
                              ? size_setting
                              : thp_setting("/sys/kernel/mm/transparent_hugepage/shmem_enabled", line, sizeof line);
    /* Unreadable: a kernel without THP for shmem at all. */
    if (!setting || strncmp(setting, "[never]", 7) == 0 || strncmp(setting, "[deny]", 6) == 0)
        return "not given to shared memory (/sys/kernel/mm/transparent_hugepage/shmem_enabled)";
    return NULL;
}

kva_status kva_os_shared_dup(int fd, int *out) {
    int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return kva_fail(KVA_ERR_BACKEND, "dup of the shared memory descriptor: %s", strerror(errno));
    *out = copy;
    return KVA_OK;
}

/* Whether fd is a memfd named KVA_OS_SHARED_NAME: its /proc link reads
 * "/memfd:kvalloc.pool (deleted)". */
static int named_ours(int fd) {
    char link[64], target[128];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return 0;
    target[n] = '\0';
    static const char want[] = "/memfd:" KVA_OS_SHARED_NAME " (deleted)";
    return strcmp(target, want) == 0;
}

kva_status kva_os_shared_map(int fd, void **addr, size_t *length) {
    struct stat st;
    if (fstat(fd, &st) != 0) return kva_fail(KVA_ERR_INVALID, "descriptor %d: fstat: %s", fd, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return kva_fail(KVA_ERR_INVALID, "descriptor %d is %s, not a kvalloc shared pool", fd, file_kind(st.st_mode));
    /* F_GET_SEALS fails on anything but a memfd (or other sealable shmem). */
    int seals = fcntl(fd, F_GET_SEALS);
    int want = F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL;
    if (seals != want || !named_ours(fd))
        return kva_fail(KVA_ERR_INVALID, "descriptor %d is not a kvalloc shared pool (%s)", fd,
                        seals < 0       ? "not a memfd"
                        : seals != want ? "its seals are not the pool's"
                                        : "not named " KVA_OS_SHARED_NAME);
    /* The map is read-write: a descriptor opened otherwise (a reopening of /proc/PID/fd/N) is the
     * caller's mistake, not a failure of the system. */
    int mode = fcntl(fd, F_GETFL);
    if (mode < 0 || (mode & O_ACCMODE) != O_RDWR)
        return kva_fail(KVA_ERR_INVALID, "descriptor %d of the shared pool is not open for reading and writing", fd);
    /* The size again, now that the seals are known: before them, whoever made the object could
     * still have shrunk it, and a map past its end would fault at the first touch there. */
    if (fstat(fd, &st) != 0) return kva_fail(KVA_ERR_INVALID, "descriptor %d: fstat: %s", fd, strerror(errno));
    if (st.st_size <= 0) return kva_fail(KVA_ERR_INVALID, "descriptor %d is an empty object", fd);
    size_t size = (size_t)st.st_size;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return kva_fail(KVA_ERR_BACKEND, "mmap of the %zu-byte shared pool: %s", size, strerror(errno));
    *addr = p;
    *length = size;
    return KVA_OK;
}

kva_status kva_os_mbind(void *addr, size_t length, int mode, const unsigned long *nodemask, unsigned long maxnode) {
    if (fails_now(KVA_OS_MBIND) || syscall(SYS_mbind, addr, length, mode, nodemask, maxnode, 0u) != 0)
        return kva_fail(KVA_ERR_BACKEND, "mbind of %zu bytes (mode %d): %s", length, mode, strerror(errno));
    return KVA_OK;
}

kva_status kva_os_get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode, const void *addr,
                                unsigned long flags) {
    if (syscall(SYS_get_mempolicy, mode, nodemask, maxnode, addr, flags) != 0)
        return kva_fail(KVA_ERR_BACKEND, "get_mempolicy(flags %#lx): %s", flags, strerror(errno));
    return KVA_OK;
}

int kva_os_path_exists(const char *path) { return access(path, F_OK) == 0; }

kva_status kva_os_lock(void *addr, size_t length) {
    if (fails_now(KVA_OS_LOCK) || mlock(addr, length) != 0) {
        int err = errno;
        struct rlimit limit;
        if ((err == ENOMEM || err == EPERM) && getrlimit(RLIMIT_MEMLOCK, &limit) == 0 &&
            limit.rlim_cur != RLIM_INFINITY)
            return kva_fail(KVA_ERR_BACKEND, "mlock of %zu bytes: %s (RLIMIT_MEMLOCK is %llu bytes)", length,
                            strerror(err), (unsigned long long)limit.rlim_cur);
        return kva_fail(KVA_ERR_BACKEND, "mlock of %zu bytes: %s", length, strerror(err));
    }
    return KVA_OK;
}

kva_status kva_os_library_open(const char *path, void **handle) {
    if (fails_now(KVA_OS_LIBRARY)) return kva_fail(KVA_ERR_BACKEND, "dlopen(%s): %s", path, strerror(errno));
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        return kva_fail(KVA_ERR_BACKEND, "dlopen(%s): %s", path, why ? why : "unknown error");
    }
    *handle = lib;
    return KVA_OK;
}

void *kva_os_library_symbol(void *handle, const char *name) { return dlsym(handle, name); }

void kva_os_library_close(void *handle) {
    if (handle) dlclose(handle);
}

const char *kva_os_getenv(const char *name) { return secure_getenv(name); }

static uint64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t kva_os_realtime_ns(void) { return clock_ns(CLOCK_REALTIME); }
uint64_t kva_os_monotonic_ns(void) { return clock_ns(CLOCK_MONOTONIC); }
/* Cached per thread: the trace path must not make a system call per record. */
unsigned kva_os_thread_id(void) {
    static _Thread_local unsigned tid;
    if (tid == 0) tid = (unsigned)syscall(SYS_gettid);
    return tid;
}
unsigned kva_os_pid(void) { return (unsigned)getpid(); }
