/*
 * test_fork.c — fork while other threads use the pool: the child finds every lock free and the
 * metadata consistent (kva_check), and works (what the other threads' caches held stays theirs:
 * fork.c says why);
 * repeated while workers churn through slow paths, so a fork lands inside them. A child that
 * hangs on a lock is killed by the alarm and fails the test.
 */
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "segment.h"
#include "thread_util.h"

#define WORKERS 3
#define FORKS 40

static kva_pool *pool;
static atomic_int stop;

static void *churn(void *arg) {
    uint64_t rng = (uint64_t)(uintptr_t)arg + 1;
    void *held[64] = {0};
    while (!atomic_load(&stop)) {
        unsigned i = (unsigned)(rng_next(&rng) % 64);
        if (held[i]) {
            TCHECK_STATUS(kva_free(pool, held[i]), KVA_OK);
            held[i] = NULL;
        } else {
            size_t size = rng_next(&rng) % 8 == 0 ? (size_t)(rng_next(&rng) % (256 << 10)) + 1
                                                  : (size_t)(rng_next(&rng) % 4096) + 1;
            TCHECK_STATUS(kva_alloc(pool, size, &held[i]), KVA_OK);
        }
        if (rng_next(&rng) % 512 == 0) kva_thread_flush(pool);
    }
    for (unsigned i = 0; i < 64; i++)
        if (held[i]) TCHECK_STATUS(kva_free(pool, held[i]), KVA_OK);
    return NULL;
}

/* The child: only this thread survives. Exit status 0 if all is well. */
static int in_child(uint64_t live_of_mine) {
    hang_guard("a child forked beside churning workers", HANG_GUARD_SECONDS);
    if (kva_check(pool) != KVA_OK) {
        fprintf(stderr, "child: %s\n", kva_last_error());
        return 10;
    }
    kva_stats st;
    if (kva_get_stats(pool, &st) != KVA_OK) return 11;
    if (st.live_allocations < live_of_mine) return 13;
    void *p[500];
    for (int i = 0; i < 500; i++)
        if (kva_alloc(pool, 16 + (size_t)i * 8, &p[i]) != KVA_OK) return 14;
    for (int i = 0; i < 500; i++)
        if (kva_free(pool, p[i]) != KVA_OK) return 15;
    if (kva_check(pool) != KVA_OK) return 16;
    return 0;
}

/* A named pool: the child, which destroys it, neither writes nor removes the parent's segment. */
static void named_pool_survives_the_child(void) {
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)16 << 20;
    cfg.name = "forktest";
    kva_pool *named = NULL;
    REQUIRE(kva_pool_create(&cfg, &named) == KVA_OK);
    char path[256];
    snprintf(path, sizeof path, "/dev/shm%s", kva_stats_segment_name(named));
    REQUIRE(access(path, F_OK) == 0);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        void *p;
        int ok = kva_alloc(named, 64, &p) == KVA_OK && kva_stats_publish(named) == KVA_OK;
        kva_pool_destroy(named);
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(access(path, F_OK) == 0); /* still there for the parent's inspectors */
    CHECK_STATUS(kva_stats_publish(named), KVA_OK);
    kva_pool_destroy(named);
    CHECK(access(path, F_OK) != 0);
}

/* Named pools come and go on another thread while this one forks; each child makes and
 * destroys a named pool of its own, which takes the lock of the segment list (as the child's
 * exit hook would; the child leaves by _exit so that LeakSanitizer does not count the other
 * thread's pool, which the child never had, as leaked). A child that inherited that lock held
 * would hang there, and its alarm kills it. Creating a pool holds the lock for a moment only,
 * so the other thread also holds it itself for a while at a time, as a slow creation would:
 * then most forks land while it is held. */
static void *named_churn(void *arg) {
    (void)arg;
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)4 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    cfg.name = "forkchurn";
    while (!atomic_load(&stop)) {
        kva_pool *named;
        TCHECK_STATUS(kva_pool_create(&cfg, &named), KVA_OK);
        kva_pool_destroy(named);
        kva_segments_lock();
        usleep(200);
        kva_segments_unlock();
        sched_yield();
    }
    return NULL;
}

static void children_exit_beside_named_pools(void) {
    atomic_store(&stop, 0);
    pthread_t churner;
    REQUIRE(pthread_create(&churner, NULL, named_churn, NULL) == 0);
    int failed = 0;
    for (int f = 0; f < 100 && !failed; f++) { /* the first hung child is enough */
        pid_t pid = fork();
        REQUIRE(pid >= 0);
        if (pid == 0) {
            hang_guard("a child making a named pool", HANG_GUARD_SECONDS);
            kva_config cfg;
            kva_config_init(&cfg);
            cfg.capacity = (size_t)4 << 20;
            cfg.pages = KVA_PAGES_SMALL;
            cfg.name = "forkchild";
            kva_pool *own;
            if (kva_pool_create(&cfg, &own) != KVA_OK) _exit(3);
            kva_pool_destroy(own);
            _exit(0);
        }
        int status = 0;
        REQUIRE(waitpid(pid, &status, 0) == pid);
        failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    atomic_store(&stop, 1);
    pthread_join(churner, NULL);
    thread_failures_merge();
    CHECK(failed == 0);
}

/* Pools being created while the process forks: a child forked in the middle of a creation (its
 * segment made, its pool not yet tracked for fork) must let go of that segment too, or its exit
 * hook removes the parent's live segment. Run in a process of its own (main's
 * --exiting-children) whose leak check is off: each child leaves by exit(), to run the hook, and
 * LeakSanitizer would count the creating thread's pool, which the child never had, as leaked. */
#define KEPT 400
static kva_pool *kept[KEPT];
static atomic_int kept_all;

static void *create_kept(void *arg) {
    (void)arg;
    for (int i = 0; i < KEPT; i++) {
        char name[32];
        snprintf(name, sizeof name, "kept%d", i);
        kva_config cfg;
        kva_config_init(&cfg);
        cfg.capacity = (size_t)1 << 20;
        cfg.pages = KVA_PAGES_SMALL;
        cfg.name = name;
        TCHECK_STATUS(kva_pool_create(&cfg, &kept[i]), KVA_OK);
    }
    atomic_store(&kept_all, 1);
    return NULL;
}

static int exiting_children(void) {
    pthread_t creator;
    REQUIRE(pthread_create(&creator, NULL, create_kept, NULL) == 0);
    int forks = 0, failed = 0, missing = 0;
    while (!atomic_load(&kept_all)) {
        pid_t pid = fork();
        REQUIRE(pid >= 0);
        if (pid == 0) {
            hang_guard("a child exiting while pools are made", HANG_GUARD_SECONDS);
            exit(0);
        }
        int status = 0;
        REQUIRE(waitpid(pid, &status, 0) == pid);
        failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
        forks++;
    }
    pthread_join(creator, NULL);
    thread_failures_merge();
    for (int i = 0; i < KEPT; i++) {
        char path[256];
        snprintf(path, sizeof path, "/dev/shm%s", kva_stats_segment_name(kept[i]));
        missing += access(path, F_OK) != 0;
        kva_pool_destroy(kept[i]);
    }
    printf("test_fork --exiting-children: %d forks, %d children failed, %d of %d live segments removed\n", forks,
           failed, missing, KEPT);
    return failed || missing || check_failures ? 1 : 0;
}

static void children_exit_while_pools_are_made(const char *self) {
    const char *asan = getenv("ASAN_OPTIONS"), *tsan = getenv("TSAN_OPTIONS");
    char options[512], thread_options[512];
    snprintf(options, sizeof options, "%s%sdetect_leaks=0", asan ? asan : "", asan && *asan ? ":" : "");
    /* The fork handlers there hold three locks per pool, hundreds of them: ThreadSanitizer's
     * deadlock detector tracks at most 64 held locks and aborts on its own limit when they
     * exceed it. Its race detection stays on. */
    snprintf(thread_options, sizeof thread_options, "%s%sdetect_deadlocks=0", tsan ? tsan : "",
             tsan && *tsan ? ":" : "");
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        setenv("ASAN_OPTIONS", options, 1);
        setenv("TSAN_OPTIONS", thread_options, 1);
        execl(self, self, "--exiting-children", (char *)NULL);
        _exit(127);
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--exiting-children") == 0) return exiting_children();
    kva_config cfg;
    kva_config_init(&cfg);
    cfg.capacity = (size_t)256 << 20;
    cfg.pages = KVA_PAGES_SMALL;
    REQUIRE(kva_pool_create(&cfg, &pool) == KVA_OK);
    void *mine;
    REQUIRE(kva_alloc(pool, 100, &mine) == KVA_OK);
    pthread_t workers[WORKERS];
    for (long w = 0; w < WORKERS; w++) REQUIRE(pthread_create(&workers[w], NULL, churn, (void *)w) == 0);
    int failed = 0;
    for (int f = 0; f < FORKS; f++) {
        usleep(2000);
        pid_t pid = fork();
        REQUIRE(pid >= 0);
        if (pid == 0) _exit(in_child(1));
        int status = 0;
        REQUIRE(waitpid(pid, &status, 0) == pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "fork %d: child %s %d\n", f, WIFEXITED(status) ? "exited with" : "killed by signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
            failed++;
        }
    }
    atomic_store(&stop, 1);
    for (int w = 0; w < WORKERS; w++) pthread_join(workers[w], NULL);
    thread_failures_merge();
    CHECK(failed == 0);
    CHECK_STATUS(kva_free(pool, mine), KVA_OK);
    CHECK_STATUS(kva_check(pool), KVA_OK);
    named_pool_survives_the_child();
    children_exit_beside_named_pools();
    children_exit_while_pools_are_made("/proc/self/exe");
    printf("test_fork: %d forks beside %d threads\n", FORKS, WORKERS);
    kva_pool_destroy(pool);
    return CHECK_DONE();
}
