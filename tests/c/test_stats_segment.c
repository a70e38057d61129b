/*
 * test_stats_segment.c — the shared-memory statistics segment of a named pool, read the way an
 * inspector in another process reads it: mapped read-only, copied under the sequence lock.
 */
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <sys/file.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "child.h"
#include "thread_util.h"
#include "kv_cache.h" /* the cache's lock, held by hand as another thread's call would */
#include "kvalloc.h"
#include "kvalloc_stats.h"

/* A read-only mapping of a segment, as a reader has it. */
typedef struct mapped {
    const unsigned char *base;
    size_t size;
} mapped;

static int map_segment(const char *name, mapped *m) {
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0) return 0;
    struct stat st;
    fstat(fd, &st);
    m->size = (size_t)st.st_size;
    m->base = mmap(NULL, m->size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    return m->base != MAP_FAILED;
}

static void unmap_segment(mapped *m) { munmap((void *)m->base, m->size); }

/* Copies the whole segment into buf under the sequence lock; 0 if no consistent copy was had in
 * `tries` attempts. */
static int snapshot(const mapped *m, unsigned char *buf, int tries) {
    const kva_shm_header *h = (const kva_shm_header *)m->base;
    for (int i = 0; i < tries; i++) {
        uint64_t before = __atomic_load_n(&h->sequence, __ATOMIC_ACQUIRE);
        if (before & 1) {
            sched_yield(); /* a publish is in progress: let the writer finish it */
            continue;
        }
        memcpy(buf, m->base, m->size);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&h->sequence, __ATOMIC_RELAXED) == before) return 1;
    }
    return 0;
}

/* The section of a kind, bounds-checked against the segment size; NULL if absent or bad. */
static const void *section(const unsigned char *buf, size_t size, uint32_t kind, uint64_t *len) {
    const kva_shm_header *h = (const kva_shm_header *)buf;
    for (uint32_t i = 0; i < h->section_count && i < KVA_SHM_MAX_SECTIONS; i++) {
        const kva_shm_section *s = &h->sections[i];
        if (s->kind == kind && s->offset <= size && s->size <= size - s->offset) {
            *len = s->size;
            return buf + s->offset;
        }
    }
    return NULL;
}

static kva_pool *make_named(const char *name, int trace) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)32 << 20;
    cfg.name = name;
    cfg.trace = trace;
    cfg.pages = KVA_PAGES_SMALL;
    kva_pool *pool = NULL;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    return pool;
}

static void test_layout_and_content(void) {
    kva_pool *pool = make_named("layout", 0);
    const char *name = kva_stats_segment_name(pool);
    char expected[128];
    snprintf(expected, sizeof expected, "/kvalloc.%d.layout", (int)getpid());
    REQUIRE(name && strcmp(name, expected) == 0);
    char path[160];
    snprintf(path, sizeof path, "/dev/shm%s", name);
    struct stat st;
    REQUIRE(stat(path, &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);

    void *p[100];
    for (int i = 0; i < 100; i++) REQUIRE(kva_alloc(pool, i < 50 ? 64 : 200000, &p[i]) == KVA_OK);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);

    mapped m;
    REQUIRE(map_segment(name, &m));
    unsigned char *buf = malloc(m.size);
    REQUIRE(snapshot(&m, buf, 100));
    const kva_shm_header *h = (const kva_shm_header *)buf;
    CHECK(h->magic == KVA_SHM_MAGIC && h->abi_major == KVA_SHM_ABI_MAJOR);
    CHECK(h->header_size == sizeof(kva_shm_header) && h->segment_size == m.size);
    CHECK(h->writer_pid == (uint32_t)getpid());
    CHECK(strcmp(h->pool_name, "layout") == 0);
    CHECK(h->heartbeat_ns >= h->start_time_ns && h->publish_count >= 2);

    uint64_t len;
    const kva_shm_summary *sum = section(buf, m.size, KVA_SHM_SECTION_SUMMARY, &len);
    REQUIRE(sum && len >= sizeof *sum);
    kva_stats stats;
    kva_get_stats(pool, &stats);
    CHECK(sum->capacity == stats.capacity && sum->bytes_in_use == stats.bytes_in_use);
    CHECK(sum->bytes_free == stats.bytes_free && sum->live_allocations == 100);
    CHECK(sum->unusable_index[0] == 0.0);
    CHECK(sum->unusable_index[stats.num_orders - 1] <= 1.0);

    const kva_shm_heapmap *map = section(buf, m.size, KVA_SHM_SECTION_HEAPMAP, &len);
    REQUIRE(map && len >= sizeof *map + 2 * (uint64_t)map->cells);
    CHECK(map->cells * map->cell_bytes >= stats.capacity);
    const uint8_t *state = (const uint8_t *)(map + 1), *fill = state + map->cells;
    uint64_t used_cells = 0;
    for (uint32_t i = 0; i < map->cells; i++) used_cells += state[i] != KVA_SHM_CELL_FREE;
    CHECK(used_cells * map->cell_bytes >= stats.bytes_in_use - stats.slab_bytes);
    CHECK(state[map->cells - 1] == KVA_SHM_CELL_FREE && fill[map->cells - 1] == 0);

    const kva_shm_classes *classes = section(buf, m.size, KVA_SHM_SECTION_CLASSES, &len);
    REQUIRE(classes && classes->count == KVA_NUM_SIZE_CLASSES);
    const kva_shm_class *c64 = (const kva_shm_class *)(classes + 1) + kva_size_class_of(64);
    CHECK(c64->object_size == 64 && c64->live_objects == 50 && c64->slabs == 1 && c64->allocs == 50);

    const kva_shm_slabs *slabs = section(buf, m.size, KVA_SHM_SECTION_SLABS, &len);
    REQUIRE(slabs && slabs->count == 1);
    const kva_shm_slab *slab = (const kva_shm_slab *)(slabs + 1);
    CHECK(slab->inuse == 50 && slab->strip[0] > 0 && slab->strip[KVA_SHM_STRIP_CELLS - 1] == 0);

    /* A failed call is recorded even without trace; a successful one is not. */
    const kva_shm_trace *trace = section(buf, m.size, KVA_SHM_SECTION_TRACE, &len);
    REQUIRE(trace);
    uint64_t written = trace->written;
    CHECK(written == 0);
    CHECK_STATUS(kva_free(pool, p[0]), KVA_OK);
    CHECK_STATUS(kva_free(pool, p[0]), KVA_ERR_DOUBLE_FREE);
    REQUIRE(snapshot(&m, buf, 100));
    trace = section(buf, m.size, KVA_SHM_SECTION_TRACE, &len);
    CHECK(trace->written == 1);
    const kva_shm_trace_record *r = (const kva_shm_trace_record *)(trace + 1);
    CHECK(r->op == KVA_SHM_OP_FREE && r->status == KVA_ERR_DOUBLE_FREE && r->thread != 0);
    void *base;
    kva_pool_base(pool, &base);
    CHECK(r->offset == (uint64_t)((unsigned char *)p[0] - (unsigned char *)base));

    free(buf);
    unmap_segment(&m);
    kva_pool_destroy(pool);
    CHECK(stat(path, &st) != 0); /* gone with the pool */
}

/* With trace on, every call is recorded and timed, fast-path ones included. */
static void test_trace_mode(void) {
    kva_pool *pool = make_named("traced", 1);
    void *p[10];
    for (int i = 0; i < 10; i++) REQUIRE(kva_alloc(pool, 64, &p[i]) == KVA_OK);
    for (int i = 0; i < 10; i++) REQUIRE(kva_free(pool, p[i]) == KVA_OK);
    void *out;
    CHECK_STATUS(kva_alloc(pool, 0, &out), KVA_ERR_INVALID);
    mapped m;
    REQUIRE(map_segment(kva_stats_segment_name(pool), &m));
    unsigned char *buf = malloc(m.size);
    REQUIRE(snapshot(&m, buf, 100));
    uint64_t len;
    CHECK(((const kva_shm_header *)buf)->capabilities & KVA_SHM_CAP_TRACE_ALL);
    const kva_shm_trace *trace = section(buf, m.size, KVA_SHM_SECTION_TRACE, &len);
    CHECK(trace->written == 21 && trace->entry_size == sizeof(kva_shm_trace_record));
    const kva_shm_trace_record *r = (const kva_shm_trace_record *)(trace + 1);
    CHECK(r[0].op == KVA_SHM_OP_ALLOC && r[0].size == 64 && r[0].status == KVA_OK);
    CHECK(r[10].op == KVA_SHM_OP_FREE && r[10].offset == r[0].offset);
    CHECK(r[20].status == KVA_ERR_INVALID && r[20].offset == UINT64_MAX);
    const kva_shm_latency *lat = section(buf, m.size, KVA_SHM_SECTION_LATENCY, &len);
    uint64_t allocs = 0, frees = 0;
    for (int b = 0; b < KVA_SHM_LATENCY_BUCKETS; b++) allocs += lat->alloc[b], frees += lat->free[b];
    CHECK(allocs == 11 && frees == 10);
    kva_stats st;
    kva_get_stats(pool, &st);
    CHECK(st.alloc_count == 10 && st.free_count == 10 && st.rejected_calls == 1);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    free(buf);
    unmap_segment(&m);
    kva_pool_destroy(pool);
}

/* Whether the writer of a segment is alive, by its liveness lock: an exclusive flock can be
 * had only once the writer is gone. */
static int writer_holds_lock(const char *name) {
    int fd = shm_open(name, O_RDONLY, 0);
    REQUIRE(fd >= 0);
    int held = flock(fd, LOCK_EX | LOCK_NB) != 0;
    close(fd); /* closing drops the lock if we got it */
    return held;
}

/* The writer holds its liveness lock while it lives and the kernel drops it when the process is
 * killed, where the segment itself stays behind. */
static void test_liveness_lock(void) {
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    pid_t child = fork();
    if (child == 0) {
        kva_pool *pool = make_named("doomed", 0);
        const char *n = kva_stats_segment_name(pool);
        if (write(fds[1], n, strlen(n) + 1) < 0) _exit(2);
        pause(); /* until killed */
        _exit(0);
    }
    char name[128] = {0};
    REQUIRE(read(fds[0], name, sizeof name - 1) > 0);
    CHECK(writer_holds_lock(name));
    mapped m;
    REQUIRE(map_segment(name, &m));
    const kva_shm_header *h = (const kva_shm_header *)m.base;
    CHECK(h->capabilities & KVA_SHM_CAP_LIVENESS_LOCK);
    CHECK(!(h->capabilities & KVA_SHM_CAP_TRACE_ALL));
    CHECK(h->abi_minor >= 1);
    uint64_t len;
    const kva_shm_summary *sum = section(m.base, m.size, KVA_SHM_SECTION_SUMMARY, &len);
    CHECK(sum && sum->publish_interval_ms == 200 && sum->numa_node == -1);
    const kva_shm_classes *classes = section(m.base, m.size, KVA_SHM_SECTION_CLASSES, &len);
    CHECK(classes && classes->entry_size == sizeof(kva_shm_class) &&
          len == sizeof *classes + classes->count * (uint64_t)classes->entry_size);
    unmap_segment(&m);
    kill(child, SIGKILL);
    int status;
    waitpid(child, &status, 0);
    CHECK(!writer_holds_lock(name)); /* gone, though its segment is still there */
    shm_unlink(name);
    close(fds[0]);
    close(fds[1]);
}

/* A child forked by the writer holds no part of its lock: when the writer is killed, its
 * segment reads as abandoned while the child still runs; and the child's own exit (atexit
 * hooks included) leaves a live writer's segment in place. */
static void test_forked_child_of_the_writer(void) {
    int fds[2], hold[2], ready[2]; /* hold: the children wait on it, and see its end if the test dies */
    REQUIRE(pipe(fds) == 0 && pipe(hold) == 0 && pipe(ready) == 0);
    pid_t writer = fork();
    if (writer == 0) {
        close(hold[1]);
        kva_pool *pool = make_named("parent", 0);
        pid_t quitter = fork();
        if (quitter == 0) exit(0); /* a normal exit: the atexit hook runs in the child */
        int status;
        waitpid(quitter, &status, 0);
        pid_t sleeper = fork();
        char byte;
        if (sleeper == 0) {
            /* Running, so past fork's child handler: the writer waits for this. */
            if (write(ready[1], "r", 1) < 0) _exit(2);
            if (read(hold[0], &byte, 1) < 0) _exit(2); /* outlives the writer, until the test ends */
            _exit(0);
        }
        if (read(ready[0], &byte, 1) != 1) _exit(2);
        char msg[160];
        snprintf(msg, sizeof msg, "%d %s", (int)sleeper, kva_stats_segment_name(pool));
        if (write(fds[1], msg, strlen(msg) + 1) < 0) _exit(2);
        if (read(hold[0], &byte, 1) < 0) _exit(2); /* until killed */
        _exit(0);
    }
    close(hold[0]);
    char msg[160] = {0};
    REQUIRE(read(fds[0], msg, sizeof msg - 1) > 0);
    int sleeper = 0;
    char name[128] = {0};
    REQUIRE(sscanf(msg, "%d %127s", &sleeper, name) == 2);
    CHECK(shm_open(name, O_RDONLY, 0) >= 0); /* the first child's exit left it */
    CHECK(writer_holds_lock(name));
    kill(writer, SIGKILL);
    int status;
    waitpid(writer, &status, 0);
    CHECK(!writer_holds_lock(name)); /* the sleeping child does not keep the dead writer alive */
    kill(sleeper, SIGKILL);
    shm_unlink(name);
    close(fds[0]);
    close(fds[1]);
    close(hold[1]);
    close(ready[0]);
    close(ready[1]);
}

/* Two live pools of one process cannot share a name: the second is refused and the first's
 * segment is untouched. A leftover of a dead writer with our pid is replaced. */
static void test_names_are_unique(void) {
    kva_pool *first = make_named("twin", 0);
    const char *name = kva_stats_segment_name(first);
    struct stat before, after;
    int fd = shm_open(name, O_RDONLY, 0);
    REQUIRE(fd >= 0 && fstat(fd, &before) == 0);
    close(fd);
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)32 << 20;
    cfg.name = "twin";
    cfg.pages = KVA_PAGES_SMALL;
    kva_pool *second = (kva_pool *)0x5e;
    CHECK_STATUS(kva_pool_create(&cfg, &second), KVA_ERR_INVALID);
    CHECK(second == (kva_pool *)0x5e);
    fd = shm_open(name, O_RDONLY, 0);
    REQUIRE(fd >= 0 && fstat(fd, &after) == 0);
    close(fd);
    CHECK(after.st_ino == before.st_ino && writer_holds_lock(name));
    CHECK_STATUS(kva_stats_publish(first), KVA_OK);
    kva_pool_destroy(first);
    CHECK(shm_open(name, O_RDONLY, 0) < 0);

    /* An abandoned segment of the name (this process's header, nobody holds its lock) is
     * replaced; test_segment_path.c has what else may be found there. */
    char stale[128];
    snprintf(stale, sizeof stale, "/kvalloc.%d.leftover", (int)getpid());
    fd = shm_open(stale, O_RDWR | O_CREAT | O_EXCL, 0600);
    kva_shm_header header = {.magic = KVA_SHM_MAGIC,
                             .abi_major = KVA_SHM_ABI_MAJOR,
                             .segment_size = 4096,
                             .writer_pid = (uint32_t)getpid()};
    REQUIRE(fd >= 0 && ftruncate(fd, 4096) == 0 && pwrite(fd, &header, sizeof header, 0) == (ssize_t)sizeof header);
    close(fd);
    kva_pool *fresh = make_named("leftover", 0);
    CHECK(strcmp(kva_stats_segment_name(fresh), stale) == 0 && writer_holds_lock(stale));
    kva_pool_destroy(fresh);
    CHECK(shm_open(stale, O_RDONLY, 0) < 0);
}

/* Another process reads it; and a process that exits without destroying its pool leaves no
 * segment behind. */
static void test_other_processes(void) {
    kva_pool *pool = make_named("shared", 0);
    void *p;
    REQUIRE(kva_alloc(pool, 1 << 20, &p) == KVA_OK);
    kva_stats_publish(pool);
    char name[128];
    snprintf(name, sizeof name, "%s", kva_stats_segment_name(pool));
    pid_t child = fork();
    if (child == 0) {
        mapped m;
        if (!map_segment(name, &m)) _exit(2);
        unsigned char *buf = malloc(m.size);
        if (!snapshot(&m, buf, 100)) _exit(3);
        uint64_t len;
        const kva_shm_summary *sum = section(buf, m.size, KVA_SHM_SECTION_SUMMARY, &len);
        _exit(sum && sum->bytes_in_use == (1u << 20) && sum->live_allocations == 1 ? 0 : 4);
    }
    int status;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    kva_pool_destroy(pool);

    int fds[2];
    REQUIRE(pipe(fds) == 0);
    child = fork();
    if (child == 0) {
        kva_pool *forgotten = make_named("forgotten", 0);
        const char *n = kva_stats_segment_name(forgotten);
        if (write(fds[1], n, strlen(n) + 1) < 0) _exit(2);
        exit(0); /* normal exit, pool never destroyed */
    }
    char child_name[128] = {0};
    CHECK(read(fds[0], child_name, sizeof child_name - 1) > 0);
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    int fd = shm_open(child_name, O_RDONLY, 0);
    CHECK(fd < 0);
    if (fd >= 0) close(fd);
    close(fds[0]);
    close(fds[1]);
}

/* Runs read(m, buf) in a child process that maps the pool's segment, as an inspector does, while
 * this process calls write(pool, i) for i = 0, 1, ... until the child ends; the child's exit
 * status is read's (0: satisfied). */
static void read_beside_writer(kva_pool *pool, int (*read)(const mapped *m, unsigned char *buf),
                               void (*write)(kva_pool *pool, unsigned i)) {
    char name[128];
    snprintf(name, sizeof name, "%s", kva_stats_segment_name(pool));
    fflush(stderr);
    pid_t reader = fork();
    REQUIRE(reader >= 0);
    if (reader == 0) {
        mapped m;
        if (!map_segment(name, &m)) _exit(2);
        unsigned char *buf = malloc(m.size);
        _exit(buf ? read(&m, buf) : 3);
    }
    int status = 0;
    for (unsigned i = 0; waitpid(reader, &status, WNOHANG) == 0; i++) write(pool, i);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fprintf(stderr, "reader exit status %d\n", WEXITSTATUS(status));
}

/* A reader racing a writer that publishes continuously never accepts a torn snapshot: every
 * accepted copy satisfies the relations that hold within one publish. */
static int read_summaries(const mapped *m, unsigned char *buf) {
    int accepted = 0;
    for (int i = 0; i < 5000; i++) {
        if (!snapshot(m, buf, 1000)) continue;
        accepted++;
        uint64_t len;
        const kva_shm_summary *s = section(buf, m->size, KVA_SHM_SECTION_SUMMARY, &len);
        uint64_t free_bytes = 0;
        for (uint32_t k = 0; k < s->num_orders && k < 48; k++) free_bytes += s->free_blocks[k] * (s->min_block << k);
        if (free_bytes != s->bytes_free || s->alloc_count - s->free_count != s->live_allocations ||
            s->bytes_in_use + s->bytes_free + s->slab_free_bytes > s->capacity)
            return 5; /* torn */
    }
    return accepted > 100 ? 0 : 6;
}

/* The writer: churn and publish, back to back with short gaps for the reader. */
static void churn_and_publish(kva_pool *pool, unsigned i) {
    static void *live[64];
    unsigned slot = i % 64;
    if (live[slot]) kva_free(pool, live[slot]), live[slot] = NULL;
    else kva_alloc(pool, (size_t)4096 << (i % 9), &live[slot]);
    kva_stats_publish(pool);
    if (i % 4 == 0) usleep(20);
}

static void test_reader_races_writer(void) {
    kva_pool *pool = make_named("race", 0);
    read_beside_writer(pool, read_summaries, churn_and_publish);
    kva_pool_destroy(pool);
}

/* A traced pool records every call. A record that made the sequence odd would leave a reader
 * of a pool in steady use no window for a consistent copy, so the ring is outside the sequence
 * lock: a reader in another process copies the segment while the writer records flat out, and
 * keeps, by the ring's protocol (kvalloc_stats.h, "The trace ring"), only records that are
 * whole: the writer's calls in order, an allocation of 64 B then its free, with times that never
 * go back. */
static int read_trace_rings(const mapped *m, unsigned char *buf) {
    uint64_t len;
    const kva_shm_trace *live = section(m->base, m->size, KVA_SHM_SECTION_TRACE, &len);
    if (!live) return 4;
    int accepted = 0;
    for (int i = 0; i < 200; i++) {
        uint64_t before = __atomic_load_n(&live->written, __ATOMIC_ACQUIRE);
        if (!snapshot(m, buf, 64)) continue; /* ends with an acquire fence */
        uint64_t after = __atomic_load_n(&live->written, __ATOMIC_ACQUIRE);
        accepted++;
        const kva_shm_trace *t = section(buf, m->size, KVA_SHM_SECTION_TRACE, &len);
        const kva_shm_trace_record *r = (const kva_shm_trace_record *)(t + 1);
        uint64_t first = (before > after + 1 ? before : after + 1), last_time = 0;
        first = first > t->capacity ? first - t->capacity : 0;
        for (uint64_t k = first; k < before; k++) {
            const kva_shm_trace_record *rec = &r[k % t->capacity];
            uint8_t op = k % 2 ? KVA_SHM_OP_FREE : KVA_SHM_OP_ALLOC;
            if (rec->op != op || rec->size != (k % 2 ? 0u : 64u) || rec->status != KVA_OK || rec->time_ns < last_time)
                return 5; /* a torn or overwritten record kept */
            last_time = rec->time_ns;
        }
    }
    return accepted >= 190 ? 0 : 6;
}

static void alloc_and_free_64(kva_pool *pool, unsigned i) {
    (void)i;
    void *p;
    if (kva_alloc(pool, 64, &p) == KVA_OK) kva_free(pool, p);
}

static void test_trace_ring_beside_a_busy_writer(void) {
    kva_pool *pool = make_named("busytrace", 1);
    read_beside_writer(pool, read_trace_rings, alloc_and_free_64);
    kva_pool_destroy(pool);
}

/* A named KV cache publishes its counters and paints its blocks into the heap map, from its
 * own calls: in paged mode it never calls the pool after creation. */
static void test_kv_cache_section(void) {
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = 2, cfg.kv_heads = 2, cfg.head_dim = 64, cfg.block_tokens = 16, cfg.num_blocks = 256;
    cfg.layout = KVA_KV_LAYOUT_BLOCKS;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.name = "kv-seg";
    kva_kv *kv;
    REQUIRE(kva_kv_create(&cfg, NULL, &kv) == KVA_OK);
    kva_kv_info info;
    kva_kv_get_info(kv, &info);
    REQUIRE(kva_stats_segment_name(info.pool));
    char name[128];
    snprintf(name, sizeof name, "%s", kva_stats_segment_name(info.pool)); /* it goes with the pool */
    uint64_t keys[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kva_kv_seq held, done, again;
    uint32_t cached;
    REQUIRE(kva_kv_seq_allocate(kv, 8 * 16, keys, 8, NULL, 0, 0, 0, &done, &cached) == KVA_OK);
    REQUIRE(kva_kv_seq_free(kv, done) == KVA_OK); /* 8 blocks stay cached */
    REQUIRE(kva_kv_seq_allocate(kv, 100 * 16, NULL, 0, NULL, 0, 0, 0, &held, &cached) == KVA_OK);
    REQUIRE(kva_kv_seq_allocate(kv, 4 * 16, keys, 4, NULL, 0, 0, 0, &again, &cached) == KVA_OK);
    CHECK(cached == 4 * 16);
    CHECK_STATUS(kva_stats_publish(info.pool), KVA_OK);

    mapped m;
    REQUIRE(map_segment(name, &m));
    unsigned char *buf = malloc(m.size);
    REQUIRE(snapshot(&m, buf, 100));
    uint64_t len;
    const kva_shm_kv *k = section(buf, m.size, KVA_SHM_SECTION_KV, &len);
    REQUIRE(k);
    CHECK(k->present == 1 && k->total_blocks == 256 && k->block_tokens == 16);
    CHECK(k->used_blocks == 104 && k->cached_blocks == 4 && k->free_blocks == 148);
    CHECK(k->hit_tokens == 64 && k->live_sequences == 2);
    const kva_shm_heapmap *map = section(buf, m.size, KVA_SHM_SECTION_HEAPMAP, &len);
    const uint8_t *state = (const uint8_t *)(map + 1);
    uint32_t kv_used = 0, kv_cached = 0;
    for (uint32_t i = 0; i < map->cells; i++)
        kv_used += state[i] == KVA_SHM_CELL_KV_USED, kv_cached += state[i] == KVA_SHM_CELL_KV_CACHED;
    CHECK(kv_used > 0 && kv_cached > 0);
    /* Used cells cover about the used blocks' bytes. */
    uint64_t used_bytes = 104 * (uint64_t)info.block_bytes;
    CHECK(kv_used * map->cell_bytes >= used_bytes / 2 && kv_used * map->cell_bytes <= used_bytes * 2);

    /* A full publish while the cache's lock is busy (another thread in a cache call, here held
     * by hand) repaints the map from the buddy, where the KV memory is one allocation: the
     * cells keep what the last paint showed, not plain blocks. */
    pthread_mutex_lock(&kv->lock);
    CHECK_STATUS(kva_stats_publish(info.pool), KVA_OK);
    pthread_mutex_unlock(&kv->lock);
    REQUIRE(snapshot(&m, buf, 100));
    uint32_t kv_used_busy = 0, kv_cached_busy = 0;
    for (uint32_t i = 0; i < map->cells; i++)
        kv_used_busy += state[i] == KVA_SHM_CELL_KV_USED, kv_cached_busy += state[i] == KVA_SHM_CELL_KV_CACHED;
    CHECK(kv_used_busy == kv_used && kv_cached_busy == kv_cached);

    /* The cache's own calls publish once the interval has passed, without kva_stats_publish. */
    uint64_t before = ((const kva_shm_header *)m.base)->publish_count;
    for (int i = 0; i < 400 && ((const kva_shm_header *)m.base)->publish_count == before; i++) {
        kva_kv_seq s;
        REQUIRE(kva_kv_seq_allocate(kv, 16, NULL, 0, NULL, 0, 0, 0, &s, &cached) == KVA_OK);
        REQUIRE(kva_kv_seq_free(kv, s) == KVA_OK);
        usleep(1000);
    }
    CHECK(((const kva_shm_header *)m.base)->publish_count > before);
    free(buf);
    unmap_segment(&m);
    kva_kv_destroy(kv);
    CHECK(shm_open(name, O_RDONLY, 0) < 0);
}

/* The heap-map cells of a KV cache (blocks layout) as kvalloc_stats.h defines them, worked out
 * from the cache's blocks: the in-use kind most of a cell's blocks are (pinned, used and not
 * pinned, cached; a tie to the first), free when none is in use. Cells here cover fewer than 64
 * blocks, so every block is looked at. */
static uint8_t expected_kv_cell(const kva_kv *kv, uint64_t cell_bytes, uint64_t cell) {
    uint64_t start = kv->memory_offset, stride = kv->info.block_stride;
    uint64_t lo = cell * cell_bytes > start ? cell * cell_bytes - start : 0, hi = (cell + 1) * cell_bytes - start;
    if (hi > kv->info.kv_bytes) hi = kv->info.kv_bytes;
    uint32_t pinned = 0, used = 0, cached = 0;
    for (uint64_t b = lo / stride; b <= (hi - 1) / stride && b < kv->num_blocks; b++) {
        int pin = kv->pin_refs[b] != 0;
        pinned += pin, used += kv->blocks[b].state == KV_USED && !pin, cached += kv->blocks[b].state == KV_CACHED;
    }
    if (pinned && pinned >= used && pinned >= cached) return KVA_SHM_CELL_KV_PINNED;
    if (used && used >= cached) return KVA_SHM_CELL_KV_USED;
    return cached ? KVA_SHM_CELL_KV_CACHED : KVA_SHM_CELL_FREE;
}

/* Copies the heap map's states as a reader sees them now, into states[cells]; the cell count. */
static uint32_t read_cells(const mapped *m, unsigned char *buf, uint8_t *states, uint32_t room, uint64_t *cell_bytes) {
    REQUIRE(snapshot(m, buf, 100));
    uint64_t len;
    const kva_shm_heapmap *map = section(buf, m->size, KVA_SHM_SECTION_HEAPMAP, &len);
    REQUIRE(map && map->cells <= room);
    memcpy(states, map + 1, map->cells);
    *cell_bytes = map->cell_bytes;
    return map->cells;
}

/* The cell the block b of kv lies in. */
static uint32_t cell_of(const kva_kv *kv, uint64_t cell_bytes, uint32_t b) {
    return (uint32_t)((kv->memory_offset + (uint64_t)b * kv->info.block_stride) / cell_bytes);
}

/* Counts the cells that differ from expected_kv_cell. */
static uint32_t cells_not_as_expected(const kva_kv *kv, const uint8_t *states, uint32_t cells, uint64_t cell_bytes) {
    uint32_t wrong = 0;
    for (uint32_t c = 0; c < cells; c++) wrong += states[c] != expected_kv_cell(kv, cell_bytes, c);
    return wrong;
}

/* Pinned KV blocks paint cells of their own (KVA_SHM_CELL_KV_PINNED) by the rule in
 * kvalloc_stats.h: a cell shared by pinned and cached or used blocks is pinned when the pinned
 * ones are at least as many, used or cached when they are more; unpinning paints the map back to
 * what it showed before the pins. */
static void test_kv_pinned_cells(void) {
    kva_pool *pool = make_named("kv-pins", 0);
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    /* 512-byte blocks in a pool of 4 KiB cells: a cell covers 8 blocks */
    cfg.layers = 1, cfg.kv_heads = 1, cfg.head_dim = 16, cfg.block_tokens = 8, cfg.num_blocks = 512;
    cfg.layout = KVA_KV_LAYOUT_BLOCKS;
    kva_kv *kv;
    REQUIRE(kva_kv_create(&cfg, pool, &kv) == KVA_OK);
    mapped m;
    REQUIRE(map_segment(kva_stats_segment_name(pool), &m));
    unsigned char *buf = malloc(m.size);
    static uint8_t before[16384], now[16384];
    uint64_t cell_bytes;
    REQUIRE(buf);

    uint64_t cached_keys[64], used_keys[64];
    for (uint64_t i = 0; i < 64; i++) cached_keys[i] = 1 + i, used_keys[i] = 1001 + i;
    kva_kv_seq cached_seq, used_seq, pins[3];
    const uint32_t *table;
    uint32_t hit, length, cached_first, used_first;
    REQUIRE(kva_kv_seq_allocate(kv, 64 * 8, cached_keys, 64, NULL, 0, 0, 0, &cached_seq, &hit) == KVA_OK);
    REQUIRE(kva_kv_seq_block_table(kv, cached_seq, &table, &length) == KVA_OK && length == 64);
    cached_first = table[0];
    for (uint32_t i = 0; i < 64; i++) REQUIRE(table[i] == cached_first + i); /* one run of blocks */
    REQUIRE(kva_kv_seq_free(kv, cached_seq) == KVA_OK);                      /* 64 cached blocks */
    REQUIRE(kva_kv_seq_allocate(kv, 64 * 8, used_keys, 64, NULL, 0, 0, 0, &used_seq, &hit) == KVA_OK);
    REQUIRE(kva_kv_seq_block_table(kv, used_seq, &table, &length) == KVA_OK && length == 64);
    used_first = table[0];
    for (uint32_t i = 0; i < 64; i++) REQUIRE(table[i] == used_first + i);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    uint32_t cells = read_cells(&m, buf, before, sizeof before, &cell_bytes);
    /* the geometry the cells below are chosen for: 8 blocks a cell, each run starting one */
    REQUIRE(cell_bytes == 8 * kv->info.block_stride && kv->memory_offset % cell_bytes == 0);
    REQUIRE(cached_first % 8 == 0 && used_first % 8 == 0);
    uint32_t c0 = cell_of(kv, cell_bytes, cached_first), u0 = cell_of(kv, cell_bytes, used_first);
    for (uint32_t c = 0; c < cells; c++) CHECK(before[c] != KVA_SHM_CELL_KV_PINNED);
    CHECK(cells_not_as_expected(kv, before, cells, cell_bytes) == 0);

    /* 28 of the cached blocks pinned: 3 cells wholly, a 4th half (4 pinned, 4 cached: pinned);
     * 3 of the used sequence's blocks pinned: their cell has 5 used ones, and stays used. */
    REQUIRE(kva_kv_pin(kv, cached_keys, 28, NULL, 0, 0, &pins[0], NULL) == KVA_OK);
    REQUIRE(kva_kv_pin(kv, used_keys, 3, NULL, 0, 0, &pins[1], NULL) == KVA_OK);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    REQUIRE(read_cells(&m, buf, now, sizeof now, &cell_bytes) == cells);
    for (uint32_t c = c0; c < c0 + 4; c++) CHECK(now[c] == KVA_SHM_CELL_KV_PINNED);
    for (uint32_t c = c0 + 4; c < c0 + 8; c++) CHECK(now[c] == KVA_SHM_CELL_KV_CACHED);
    for (uint32_t c = u0; c < u0 + 8; c++) CHECK(now[c] == KVA_SHM_CELL_KV_USED);
    CHECK(cells_not_as_expected(kv, now, cells, cell_bytes) == 0);

    /* A 4th pinned block in that cell (a pin over the first 3 again, and one more): 4 and 4,
     * pinned. */
    REQUIRE(kva_kv_pin(kv, used_keys, 4, NULL, 0, 0, &pins[2], NULL) == KVA_OK);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    REQUIRE(read_cells(&m, buf, now, sizeof now, &cell_bytes) == cells);
    CHECK(now[u0] == KVA_SHM_CELL_KV_PINNED && now[u0 + 1] == KVA_SHM_CELL_KV_USED);
    CHECK(cells_not_as_expected(kv, now, cells, cell_bytes) == 0);

    /* A busy publish keeps the pinned cells as painted. */
    pthread_mutex_lock(&kv->lock);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    pthread_mutex_unlock(&kv->lock);
    static uint8_t busy[16384];
    REQUIRE(read_cells(&m, buf, busy, sizeof busy, &cell_bytes) == cells);
    CHECK(memcmp(busy, now, cells) == 0);

    /* Unpinned: the blocks are what they were (cached, used), and so is the map. */
    for (int i = 0; i < 3; i++) CHECK_STATUS(kva_kv_unpin(kv, pins[i]), KVA_OK);
    CHECK_STATUS(kva_stats_publish(pool), KVA_OK);
    REQUIRE(read_cells(&m, buf, now, sizeof now, &cell_bytes) == cells);
    CHECK(memcmp(now, before, cells) == 0);
    CHECK_STATUS(kva_kv_check(kv), KVA_OK);

    free(buf);
    unmap_segment(&m);
    kva_kv_destroy(kv);
    kva_pool_destroy(pool);
}

/* The KV section of a segment read now: total_blocks of the cache publishing there, 0 if
 * none is. */
static uint64_t published_kv_blocks(kva_pool *pool) {
    REQUIRE(kva_stats_publish(pool) == KVA_OK);
    mapped m;
    REQUIRE(map_segment(kva_stats_segment_name(pool), &m));
    unsigned char *buf = malloc(m.size);
    REQUIRE(buf && snapshot(&m, buf, 100));
    uint64_t len;
    const kva_shm_kv *k = section(buf, m.size, KVA_SHM_SECTION_KV, &len);
    REQUIRE(k);
    uint64_t blocks = k->present ? k->total_blocks : 0;
    free(buf);
    unmap_segment(&m);
    return blocks;
}

/* Two caches on one named pool: the first keeps the segment's one KV section while the second
 * comes and goes; once the first is gone, the section says no cache. */
static void test_two_caches_on_one_pool(void) {
    kva_pool *pool = make_named("two-caches", 0);
    kva_kv_config cfg;
    kva_kv_config_init(&cfg);
    cfg.layers = 2, cfg.kv_heads = 2, cfg.head_dim = 64, cfg.block_tokens = 16, cfg.num_blocks = 64;
    kva_kv *first, *second;
    REQUIRE(kva_kv_create(&cfg, pool, &first) == KVA_OK);
    cfg.num_blocks = 32;
    REQUIRE(kva_kv_create(&cfg, pool, &second) == KVA_OK);
    CHECK(published_kv_blocks(pool) == 64);
    kva_kv_destroy(second);
    CHECK(published_kv_blocks(pool) == 64); /* the second's destroy left the first's section */
    kva_kv_destroy(first);
    CHECK(published_kv_blocks(pool) == 0);
    kva_pool_destroy(pool);
}

/* Remote frees into the words of a thread that is alive and idle wait there to be merged. Since
 * a remote free is counted where it is merged, the statistics add those waiting: the class
 * section's free count did not, so one snapshot said 50 allocations, 0 frees and 0 live objects
 * for the class while its summary said 50 frees. */
static kva_pool *idle_pool;
static void *idle_objs[50];
static sem_t idle_made, idle_finish;

static void *allocate_then_idle(void *arg) {
    (void)arg;
    for (int i = 0; i < 50; i++) TCHECK_STATUS(kva_alloc(idle_pool, 64, &idle_objs[i]), KVA_OK);
    sem_post(&idle_made);
    sem_wait(&idle_finish);
    return NULL;
}

static void check_published_class_64(const char *name, uint64_t allocs, uint64_t frees, uint64_t live) {
    mapped m;
    REQUIRE(map_segment(name, &m));
    unsigned char *buf = malloc(m.size);
    REQUIRE(buf && snapshot(&m, buf, 100));
    uint64_t len;
    const kva_shm_summary *sum = section(buf, m.size, KVA_SHM_SECTION_SUMMARY, &len);
    const kva_shm_classes *classes = section(buf, m.size, KVA_SHM_SECTION_CLASSES, &len);
    REQUIRE(sum && classes && classes->count == KVA_NUM_SIZE_CLASSES);
    const kva_shm_class *c64 = (const kva_shm_class *)(classes + 1) + kva_size_class_of(64);
    CHECK(c64->allocs == allocs && c64->frees == frees && c64->live_objects == live);
    CHECK(sum->alloc_count == allocs && sum->free_count == frees && sum->live_allocations == live);
    free(buf);
    unmap_segment(&m);
}

static void test_remote_frees_published_before_their_merge(void) {
    idle_pool = make_named("remote", 0);
    REQUIRE(sem_init(&idle_made, 0, 0) == 0 && sem_init(&idle_finish, 0, 0) == 0);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, allocate_then_idle, NULL) == 0);
    sem_wait(&idle_made);
    for (int i = 0; i < 50; i++) CHECK_STATUS(kva_free(idle_pool, idle_objs[i]), KVA_OK);
    CHECK_STATUS(kva_stats_publish(idle_pool), KVA_OK);
    check_published_class_64(kva_stats_segment_name(idle_pool), 50, 50, 0);
    sem_post(&idle_finish);
    pthread_join(t, NULL);
    thread_failures_merge();
    CHECK_STATUS(kva_stats_publish(idle_pool), KVA_OK); /* merged at the thread's exit: the same */
    check_published_class_64(kva_stats_segment_name(idle_pool), 50, 50, 0);
    kva_pool_destroy(idle_pool);
    sem_destroy(&idle_made);
    sem_destroy(&idle_finish);
}

/* The segment's size does not grow without bound with the pool: the heap map has at most 16,384
 * cells, also for a pool of 2^32 - 2 blocks (a cell count computed in 32 bits would wrap to 0),
 * and the slab table lists at most KVA_SHM_SLABS_MAX slabs (else a 1 TiB pool of 64 KiB chunks
 * would make a segment of 1.3 GB, which readers refuse as corrupt). Address space only. */
static void check_geometry(size_t capacity, size_t min_block, size_t slab_chunk, uint32_t slabs_listed) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = capacity;
    cfg.min_block = min_block;
    cfg.slab_chunk = slab_chunk;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.name = "geometry";
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    if (!pool) return;
    char name[64];
    snprintf(name, sizeof name, "/kvalloc.%d.geometry", (int)getpid());
    mapped m;
    REQUIRE(map_segment(name, &m));
    CHECK(m.size < ((size_t)8 << 20));
    uint64_t len;
    const kva_shm_heapmap *map = section(m.base, m.size, KVA_SHM_SECTION_HEAPMAP, &len);
    const kva_shm_slabs *slabs = section(m.base, m.size, KVA_SHM_SECTION_SLABS, &len);
    REQUIRE(map && slabs);
    uint64_t blocks = capacity / min_block;
    CHECK(map->cells > 0 && map->cells <= 16384 && (uint64_t)map->cells * map->cell_blocks >= blocks &&
          (uint64_t)(map->cells - 1) * map->cell_blocks < blocks);
    CHECK(slabs->capacity == slabs_listed && len == sizeof *slabs + (uint64_t)slabs_listed * sizeof(kva_shm_slab));
    unmap_segment(&m);
    kva_pool_destroy(pool);
}

static void test_segment_geometry_of_huge_pools(void) {
    size_t most_blocks = ((size_t)1 << 32) - 2; /* of 256 B: 1 TiB, in 524,288 chunks of 2 MiB */
    check_geometry(most_blocks * 256, 256, 0, KVA_SHM_SLABS_MAX);
    check_geometry((size_t)1 << 40, 4096, 64 << 10, KVA_SHM_SLABS_MAX); /* 16,777,216 chunks */
    check_geometry((size_t)64 << 20, 4096, 0, 32);                      /* 32 of 2 MiB: all listed */
}

/* A /dev/shm without room for the segment (a container's 64 MiB, shared): the pool is refused,
 * where the sparse segment file killed the writer with SIGBUS at its first write. In a child
 * with a mount namespace of its own and a 16 KiB tmpfs on /dev/shm (the real one untouched). */
static int no_room_child(void) {
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=16k") != 0) {
        fprintf(stderr, "test_no_room_in_dev_shm: skipped, no private mount namespace here: %s\n", strerror(errno));
        return 77;
    }
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)64 << 20;
    cfg.name = "noroom";
    kva_pool *pool = NULL;
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_ERR_BACKEND);
    CHECK(pool == NULL && strstr(kva_last_error(), "No space") != NULL);
    cfg.name = NULL; /* an anonymous pool needs no segment */
    CHECK_STATUS(kva_pool_create(&cfg, &pool), KVA_OK);
    kva_pool_destroy(pool);
    return check_failures ? 1 : 0;
}

static void test_no_room_in_dev_shm(void) {
    in_child(no_room_child, "test_no_room_in_dev_shm"); /* a SIGBUS shows as the child's signal */
}

int main(void) {
    test_segment_geometry_of_huge_pools();
    test_no_room_in_dev_shm();
    test_layout_and_content();
    test_trace_mode();
    test_other_processes();
    test_liveness_lock();
    test_forked_child_of_the_writer();
    test_names_are_unique();
    test_kv_cache_section();
    test_kv_pinned_cells();
    test_two_caches_on_one_pool();
    test_remote_frees_published_before_their_merge();
    test_reader_races_writer();
    test_trace_ring_beside_a_busy_writer();
    return CHECK_DONE();
}
