/*
 * os.h — every operating-system call the library makes, behind one small interface.
 *
 * Contract: each function returns a kva_status (KVA_OK or KVA_ERR_BACKEND with kva_last_error()
 * naming the call and errno; kva_os_map_metadata says KVA_ERR_NOMEM when the kernel has no
 * memory) and never leaves a partial mapping behind on failure. Nothing
 * here is called once a pool exists, except kva_os_unmap at destruction.
 *
 * Tests reach every failure path through kva_os_fail_nth (at the end), which makes a chosen
 * call fail as if the kernel had refused it.
 */
#ifndef KVA_OS_H
#define KVA_OS_H

#include <stddef.h>

#include "internal.h"

#define KVA_HUGE_PAGE_SIZE ((size_t)2 << 20)

/* Reserves length bytes of address space aligned to alignment (a power of two), inaccessible.
 * *out receives the aligned start. */
kva_status kva_os_reserve(size_t length, size_t alignment, void **out);

/* What backs a range kva_os_commit makes readable and writable. */
typedef enum kva_os_backing {
    /* Base (or transparent huge) pages, committed as they are first touched and left out of the
     * kernel's overcommit accounting (MAP_NORESERVE): a pool is often far larger than what it
     * will touch (a KV cache sized for the worst case), and the heuristic would refuse a
     * mapping larger than memory. */
    KVA_OS_LAZY,
    /* The same pages, counted at once: for a range that will all be touched (prefault, lock, pin),
     * so that the kernel refuses one larger than it can back (KVA_ERR_NOMEM) rather than its
     * OOM killer striking in the middle of the touching. */
    KVA_OS_CHARGED,
    /* hugetlb 2 MiB pages, reserved at once (addr and length multiples of 2 MiB). */
    KVA_OS_HUGETLB
} kva_os_backing;

/* Replaces [addr, addr+length) of a reservation with readable, writable memory. */
kva_status kva_os_commit(void *addr, size_t length, kva_os_backing backing);

/* Advises transparent huge pages for the range. KVA_ERR_BACKEND if the kernel refuses, or if this
 * process would get none there: THP disabled for it (prctl PR_SET_THP_DISABLE, as a container
 * runtime or a parent may set) or for the system (sysfs "never"), where the advice succeeds
 * and changes nothing. */
kva_status kva_os_advise_thp(void *addr, size_t length);

/* Why this process gets no transparent huge pages in a range it advises (a phrase for an error
 * message), or NULL if it may. */
const char *kva_os_thp_unavailable(void);

/* Takes every first-touch page fault of the range now, keeping what it holds. Where
 * MADV_POPULATE_WRITE is missing (before Linux 5.14) the range is touched once per base page,
 * whatever backs it, since a huge page fault may get a base page. */
kva_status kva_os_populate(void *addr, size_t length);

/* Zeroed, lazily committed host memory for metadata (MAP_NORESERVE: the overcommit heuristic
 * does not count it, as for kva_os_commit). KVA_ERR_NOMEM if the kernel has no memory for the
 * mapping. */
kva_status kva_os_map_metadata(size_t length, void **out);

/* Releases a reservation or a metadata mapping (whole or in part). NULL or 0 is a no-op. */
void kva_os_unmap(void *addr, size_t length);

/* The system's base page size. */
size_t kva_os_page_size(void);

/* Bytes of memory this process could still commit: the least of the kernel's MemAvailable
 * (/proc/meminfo), the room left under its memory cgroup's limit (v2 memory.max less
 * memory.current, or v1 memory.limit_in_bytes less memory.usage_in_bytes) and the machine's
 * physical memory; what cannot be read is left out. 0 if none can. Reads files: for creation
 * paths only. */
size_t kva_os_available_memory(void);

/* Gives the pages of [addr, addr+length) back to the kernel (madvise MADV_DONTNEED): the range
 * stays mapped and reads zero when touched again. addr and length page aligned. */
kva_status kva_os_discard(void *addr, size_t length);

/* The same for a range of a shared memory object (madvise MADV_REMOVE): the object's pages are
 * freed, so every process that maps them reads zero there afterwards. */
kva_status kva_os_discard_shared(void *addr, size_t length);

/* At most this many first bytes of a file found at a shared-memory name are read for the
 * caller's kva_os_shm_own_fn. */
#define KVA_OS_SHM_HEAD 1024

/* The caller's test of a regular file of this user, mode 0600, found at the name it creates:
 * 1 if it is an object the caller's process made (a writer with this pid, since dead), else 0
 * with a noun phrase in why saying what it is instead ("a file without the segment magic").
 * head holds the file's first len = min(size, KVA_OS_SHM_HEAD) bytes; size is the file's. */
typedef int (*kva_os_shm_own_fn)(const void *head, size_t len, uint64_t size, char *why, size_t why_size);

/* Creates the shared-memory object `name` ("/...", the file /dev/shm/...), mode 0600, of length
 * bytes, maps it read-write and returns the mapping. The descriptor stays open (close on exec)
 * holding a shared flock for as long as the writer lives: the kernel drops the lock when the
 * process dies, however it dies, so a reader that can take the lock exclusively knows the
 * writer is gone, in whatever pid namespace either runs. On failure nothing is left.
 *
 * Something already at the name is replaced only when it is provably this process's abandoned
 * object: a regular file of this user, mode 0600, that `own` accepts, whose writer is gone
 * (nobody holds its lock). While a live writer holds it (another pool of this process with the
 * same name): KVA_ERR_INVALID. Anything else (a FIFO, socket, device, directory or symbolic
 * link; a file of another owner, mode or content) gets KVA_ERR_BACKEND naming what it is, in
 * bounded time, and is left as it is: never followed, waited on, truncated or removed, and
 * opened for reading only if it is a regular file. */
kva_status kva_os_shm_create(const char *name, size_t length, kva_os_shm_own_fn own, void **out, int *fd_out);
void kva_os_shm_unlink(const char *name);
void kva_os_close(int fd);

/* ---- shared memory objects (kva_config.shared) ---------------------------------------------
 * A pool's shared memory is a memfd named "kvalloc.pool" (KVA_OS_SHARED_NAME), of the length
 * asked for, sealed against growing and shrinking (F_SEAL_GROW | F_SEAL_SHRINK) and against
 * further seals (F_SEAL_SEAL): a process it is passed to can write the pages but never truncate
 * them away under the owner's mapping (a SIGBUS there). Nothing is in the file system. */
#define KVA_OS_SHARED_NAME "kvalloc.pool"

/* Creates the object (hugetlb: of 2 MiB pages, length a multiple of them), close on exec. */
kva_status kva_os_shared_create(size_t length, int hugetlb, int *fd_out);

/* Replaces [addr, addr+length) of a reservation with the object's first length bytes, shared
 * and read-write. */
kva_status kva_os_shared_commit(void *addr, size_t length, int fd);

/* Why a shared (shmem) range gets no transparent huge pages when advised (a phrase), or NULL
 * if it may: /sys/kernel/mm/transparent_hugepage/shmem_enabled (and its 2 MiB size's own
 * setting) "never" or "deny", or the process's prctl. */
const char *kva_os_shmem_thp_unavailable(void);

/* A new close-on-exec descriptor of the same object. */
kva_status kva_os_shared_dup(int fd, int *out);

/* Maps a descriptor that must be one of these objects: a memfd of that name whose seals are
 * exactly the three above; anything else is KVA_ERR_INVALID naming what it is, and nothing is
 * mapped. *addr and *length receive the read-write shared mapping of the whole object. */
kva_status kva_os_shared_map(int fd, void **addr, size_t *length);

/* Sets the NUMA memory policy of [addr, addr+length) (mbind(2), the raw system call: no libnuma).
 * nodemask holds maxnode bits. Call before the range is first touched. */
kva_status kva_os_mbind(void *addr, size_t length, int mode, const unsigned long *nodemask, unsigned long maxnode);

/* get_mempolicy(2): the policy of the page at addr (flags MPOL_F_ADDR), or with
 * MPOL_F_MEMS_ALLOWED the nodes this process may use. nodemask holds maxnode bits. */
kva_status kva_os_get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode, const void *addr,
                                unsigned long flags);

/* Whether a file or directory exists (for /sys/devices/system/node/node<N>). */
int kva_os_path_exists(const char *path);

/* mlock(2) of the range: every page resident and never swapped out. munmap undoes it. */
kva_status kva_os_lock(void *addr, size_t length);

/* A shared library loaded at run time (dlopen RTLD_NOW | RTLD_LOCAL); the error names dlerror().
 * Symbols are looked up with kva_os_library_symbol, NULL if absent. */
kva_status kva_os_library_open(const char *path, void **handle);
void *kva_os_library_symbol(void *handle, const char *name);
void kva_os_library_close(void *handle);

/* An environment variable, ignored in a set-user-ID program (secure_getenv). NULL if unset. */
const char *kva_os_getenv(const char *name);

uint64_t kva_os_realtime_ns(void);
uint64_t kva_os_monotonic_ns(void);
unsigned kva_os_thread_id(void);
unsigned kva_os_pid(void);

/* How many forks lie between the process that loaded the library and this one: 0 in the process
 * itself, one more in each child (os_fork.c). What a CUDA device opened in an ancestor is told by
 * (cuda_driver.h): CUDA does not survive fork. kva_os_fork_child counts a fork; the library's
 * atfork child handler (fork.c) calls it, while the child is a process of one thread. */
unsigned kva_os_fork_depth(void);
void kva_os_fork_child(void);

/* ---- fault injection, for the tests --------------------------------------------------------
 * kva_os_fail_nth(call, n, error) makes the n-th next wrapper call of that kind (KVA_OS_ANY:
 * of any kind above) fail with errno `error`, as if the kernel had refused it; n = 0 disarms.
 * It returns how many calls the previous setting still had to wait (0: it fired, or none was
 * armed), so a test learns whether its failure happened. The setting belongs to the calling
 * thread and fires once. Each wrapper pays one thread-local load for it; none of them is on a
 * hot path. Not part of the public API. */
typedef enum kva_os_call {
    KVA_OS_ANY = 0,
    KVA_OS_RESERVE,     /* kva_os_reserve */
    KVA_OS_COMMIT,      /* kva_os_commit of normal pages */
    KVA_OS_COMMIT_HUGE, /* kva_os_commit of hugetlb pages */
    KVA_OS_ADVISE,      /* kva_os_advise_thp */
    KVA_OS_POPULATE,    /* kva_os_populate (EINVAL: as before Linux 5.14, the fallback runs) */
    KVA_OS_METADATA,    /* kva_os_map_metadata */
    KVA_OS_MBIND,       /* kva_os_mbind */
    KVA_OS_LOCK,        /* kva_os_lock */
    KVA_OS_LIBRARY,     /* kva_os_library_open */
    KVA_OS_SHM,         /* kva_os_shm_create */
    KVA_OS_SHARED       /* kva_os_shared_create and kva_os_shared_commit */
} kva_os_call;

unsigned kva_os_fail_nth(kva_os_call call, unsigned n, int error);

#endif
