/*
 * bench_alloc.c — libkvalloc against glibc malloc, jemalloc, mimalloc and tcmalloc, in one run.
 *
 *     bench_alloc [--quick] [--only NAME[,NAME...]] [--rounds N] [--json FILE]
 *     bench_alloc --syscall-check [--quick]
 *
 * This process measures nothing. It starts one child process per (allocator, pattern) — see
 * bench_protocol.h for why and for the report format, bench_child.c for the patterns —
 * gathers the children's reports, and prints one table with libkvalloc's targets judged
 * against the peers measured in the same run, plus a JSON file with every figure.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_clock.h"
#include "bench_host.h"
#include "bench_protocol.h"
#include "kvalloc.h"

/* Reports of one metric by one allocator across its children: at most one per child, and an
 * allocator has at most 6 patterns x 7 processes + 2 x 7 first-touch children. */
#define MAX_REPORTS 64

struct settings {
    int quick;
    unsigned rounds;          /* batch rounds per child, after as many to warm up */
    unsigned processes;       /* fresh child processes per figure, median taken here */
    unsigned samples;         /* large-block allocations per child, after as many to warm up */
    unsigned fresh_samples;   /* the first allocations of a new pool measured per child */
    unsigned touch_processes; /* the same for the first-touch figures */
    int selected[BENCH_ALLOCATOR_COUNT];
    const char *json_path;
    int syscall_check_only;
};

struct reports {
    double value[MAX_REPORTS];
    unsigned count;
};

enum syscall_check_outcome { CHECK_NOT_RUN, CHECK_SKIPPED, CHECK_DONE };

struct syscall_check {
    enum syscall_check_outcome outcome;
    long syscalls;         /* lines strace logged between the two markers */
    char first_calls[512]; /* the first few of them, when there are any */
    char why_skipped[160];
};

struct machine {
    char cpu[128];
    long cores;
    char kernel[128];
};

static struct allocator_state g_alloc[BENCH_ALLOCATOR_COUNT];
static struct reports g_reports[BENCH_ALLOCATOR_COUNT][BENCH_METRIC_COUNT];

/* ---- options ---------------------------------------------------------------------------- */

static void usage(FILE *to)
{
    fputs("usage: bench_alloc [--quick] [--only NAME[,NAME...]] [--rounds N] [--json FILE]\n"
          "       bench_alloc --syscall-check [--quick]\n"
          "allocators: glibc jemalloc mimalloc tcmalloc kvalloc\n",
          to);
}

static void parse_options(int argc, char **argv, struct settings *s)
{
    long rounds = 0;
    *s = (struct settings){0};
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
        s->selected[a] = 1;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        int has_value = i + 1 < argc;
        if (strcmp(arg, "--quick") == 0) {
            s->quick = 1;
        } else if (strcmp(arg, "--syscall-check") == 0) {
            s->syscall_check_only = 1;
        } else if (strcmp(arg, "--only") == 0 && has_value) {
            bench_select_allocators(argv[++i], s->selected);
        } else if (strcmp(arg, "--json") == 0 && has_value) {
            s->json_path = argv[++i];
        } else if (strcmp(arg, "--rounds") == 0 && has_value) {
            char *end;
            rounds = strtol(argv[++i], &end, 10);
            if (*end != '\0' || rounds < 1 || rounds > 1000000)
                bench_die("--rounds wants a count between 1 and 1000000");
        } else if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            usage(stdout);
            exit(0);
        } else {
            usage(stderr);
            exit(1);
        }
    }
    /* The default run is sized to finish in about a minute on a 2-core machine; --quick in a
     * few seconds, for smoke runs only (its p99.9 rests on a handful of samples). */
    s->rounds = rounds ? (unsigned)rounds : s->quick ? 50 : 1000;
    s->processes = s->quick ? 3 : 7;
    s->samples = 50 * s->rounds;
    s->fresh_samples = s->quick ? 2000 : 20000;
    s->touch_processes = s->quick ? 1 : 7;
}

/* ---- the machine and the libraries ------------------------------------------------------ */

static void describe_machine(struct machine *m)
{
    bench_describe_host(m->cpu, sizeof m->cpu, &m->cores, m->kernel, sizeof m->kernel);
}

/* ---- children --------------------------------------------------------------------------- */

struct child_spec {
    enum bench_allocator allocator;
    const char *pattern;
    int prefault;
    const char *strace_log; /* run under strace, logging there; NULL for a plain run */
    int discard;            /* a warm-up run: its reports are dropped */
    unsigned samples;       /* --samples for the child; 0: the settings' large-block count */
};

/* A child's report (bench_report_fn), kept under its allocator and metric. */
static void store_report(void *ctx, const char *key, double value)
{
    enum bench_allocator allocator = *(const enum bench_allocator *)ctx;
    for (int m = 0; m < BENCH_METRIC_COUNT; m++) {
        if (strcmp(key, bench_metric_keys[m]) == 0) {
            struct reports *r = &g_reports[allocator][m];
            if (r->count == MAX_REPORTS)
                bench_die("too many reports of %s", key);
            r->value[r->count++] = value;
            return;
        }
    }
    bench_die("a child reported an unknown metric '%s'", key);
}

/* Runs one child to completion, storing what it reports. Returns its wait status. */
static int run_child(const struct settings *s, const struct child_spec *c)
{
    char rounds[16], samples[16];
    snprintf(rounds, sizeof rounds, "%u", s->rounds);
    snprintf(samples, sizeof samples, "%u", c->samples ? c->samples : s->samples);
    const char *argv[24];
    int n = 0;
    if (c->strace_log != NULL) {
        const char *trace[] = {"strace", "-f", "-qq", "-s", "64", "-o", c->strace_log};
        for (size_t i = 0; i < sizeof trace / sizeof trace[0]; i++)
            argv[n++] = trace[i];
    }
    const char *child[] = {bench_self_path(),
                           "--child",
                           bench_allocators[c->allocator].name,
                           "--pattern",
                           c->pattern,
                           "--rounds",
                           rounds,
                           "--reps",
                           "1",
                           "--samples",
                           samples,
                           "--prefault",
                           c->prefault ? "1" : "0"};
    for (size_t i = 0; i < sizeof child / sizeof child[0]; i++)
        argv[n++] = child[i];
    argv[n] = NULL;
    enum bench_allocator allocator = c->allocator;
    return bench_run_child(allocator, &g_alloc[allocator], argv, c->discard ? NULL : store_report,
                           &allocator, NULL);
}

static void run_measured(const struct settings *s, const struct child_spec *c)
{
    bench_progress("  running %-8s %-8s%s   ", bench_allocators[c->allocator].name, c->pattern,
                   c->prefault ? " prefault=1" : "           ");
    int status = run_child(s, c);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        bench_die("the %s child for pattern %s failed (status 0x%x); see its message above",
                  bench_allocators[c->allocator].name, c->pattern, (unsigned)status);
}

static int on_path(const char *program)
{
    const char *path = getenv("PATH");
    char copy[4096], full[PATH_MAX];
    snprintf(copy, sizeof copy, "%s", path != NULL ? path : "/usr/bin:/bin");
    for (char *save = NULL, *dir = strtok_r(copy, ":", &save); dir != NULL;
         dir = strtok_r(NULL, ":", &save))
        if ((size_t)snprintf(full, sizeof full, "%s/%s", dir, program) < sizeof full &&
            access(full, X_OK) == 0)
            return 1;
    return 0;
}

/* Runs the kvalloc syscall-check child under strace and counts the system calls logged
 * between its two markers: the pool exists before the first and is destroyed after the last,
 * so any line in between is a system call made on the allocation or free path. */
static void run_syscall_check(const struct settings *s, struct syscall_check *out)
{
    *out = (struct syscall_check){CHECK_SKIPPED, 0, "", ""};
    if (!on_path("strace")) {
        snprintf(out->why_skipped, sizeof out->why_skipped,
                 "strace is not installed (apt-get install -y strace)");
        return;
    }
    const char *tmp = getenv("TMPDIR");
    char log_path[PATH_MAX];
    snprintf(log_path, sizeof log_path, "%s/bench_alloc_strace.XXXXXX",
             tmp != NULL && *tmp != '\0' ? tmp : "/tmp");
    int fd = mkstemp(log_path);
    if (fd < 0)
        bench_die("mkstemp: %s", strerror(errno));
    close(fd);
    struct child_spec c = {BENCH_KVALLOC, "syscalls", 0, log_path, 0, 0};
    int status = run_child(s, &c);
    FILE *log = fopen(log_path, "r");
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || log == NULL) {
        snprintf(out->why_skipped, sizeof out->why_skipped,
                 "the child under strace failed (status 0x%x); can this process ptrace?",
                 (unsigned)status);
    } else {
        char line[1024];
        int inside = 0, begun = 0, ended = 0;
        size_t used = 0;
        while (fgets(line, sizeof line, log) != NULL) {
            if (strstr(line, BENCH_MARK_BEGIN) != NULL) {
                inside = begun = 1;
            } else if (strstr(line, BENCH_MARK_END) != NULL) {
                inside = 0;
                ended = 1;
            } else if (inside) {
                if (out->syscalls++ < 4 && used < sizeof out->first_calls - 1) {
                    bench_trim_newline(line);
                    used += (size_t)snprintf(out->first_calls + used,
                                             sizeof out->first_calls - used, "%s%s",
                                             used ? "; " : "", line);
                }
            }
        }
        if (begun && ended)
            out->outcome = CHECK_DONE;
        else
            snprintf(out->why_skipped, sizeof out->why_skipped,
                     "the markers are missing from strace's log");
    }
    if (log != NULL)
        fclose(log);
    unlink(log_path);
}

/* ---- aggregation ------------------------------------------------------------------------ */

/* One figure per (allocator, metric): the worst report for figures that are a peak or a
 * count (a fault count is the most any one process took), the median of the reports otherwise
 * (first-touch figures come from several fresh processes). NAN when nothing was reported. */
static double figure(enum bench_allocator a, enum bench_metric m)
{
    struct reports r = g_reports[a][m];
    if (r.count == 0)
        return NAN;
    qsort(r.value, r.count, sizeof r.value[0], bench_cmp_double);
    switch (m) {
    case BENCH_METADATA_BYTES:
    case BENCH_METADATA_FRACTION:
    case BENCH_METADATA_FULL_FRACTION:
    case BENCH_LARGE_MAX_NS:
    case BENCH_LARGE_FAILURES:
    case BENCH_FRESH_MAX_NS:
    case BENCH_FRESH_FAILURES:
    case BENCH_BATCH64_FAULTS:
    case BENCH_BATCH4K_FAULTS:
    case BENCH_SHUFFLED64_FAULTS:
    case BENCH_MIXED_FAULTS:
    case BENCH_LARGE_FAULT_COUNT:
    case BENCH_FRESH_FAULTS:
    case BENCH_TOUCH_FAULTS:
    case BENCH_TOUCH_PREFAULT_FAULTS:
        return r.value[r.count - 1];
    default:
        return bench_median_mean_sorted(r.value, r.count);
    }
}

/* ---- the report ------------------------------------------------------------------------- */

struct table_row {
    enum bench_metric metric;
    const char *label;
    int kvalloc_only;
    int fault_count; /* a count of page faults: no ratio (most of them are 0) */
};

/* The kvalloc column of the first-touch rows is its prefault=0 pool; the rows after them are
 * prefault=1, which only libkvalloc has. */
static const struct table_row table_rows[] = {
    {BENCH_BATCH64_NS, "64 B batch, ns/op", 0, 0},
    {BENCH_BATCH64_FAULTS, "  minor faults, timed", 0, 1},
    {BENCH_BATCH4K_NS, "4 KiB batch, ns/op", 0, 0},
    {BENCH_BATCH4K_FAULTS, "  minor faults, timed", 0, 1},
    {BENCH_SHUFFLED64_NS, "64 B, frees shuffled, ns/op", 0, 0},
    {BENCH_SHUFFLED64_FAULTS, "  minor faults, timed", 0, 1},
    {BENCH_MIXED_NS, "16 B-1 KiB mixed, ns/op", 0, 0},
    {BENCH_MIXED_FAULTS, "  minor faults, timed", 0, 1},
    {BENCH_LARGE_P50_NS, "1-64 MiB alloc p50, ns", 0, 0},
    {BENCH_LARGE_P99_NS, "1-64 MiB alloc p99, ns", 0, 0},
    {BENCH_LARGE_P999_NS, "1-64 MiB alloc p99.9, ns", 0, 0},
    {BENCH_LARGE_FAULTS, "  page faults per 1000", 0, 0},
    {BENCH_LARGE_FAULT_COUNT, "  minor faults, timed", 0, 1},
    {BENCH_FRESH_P50_NS, "fresh pool p50, ns", 0, 0},
    {BENCH_FRESH_P99_NS, "fresh pool p99, ns", 0, 0},
    {BENCH_FRESH_P999_NS, "fresh pool p99.9, ns", 0, 0},
    {BENCH_FRESH_FAULTS, "  minor faults, timed", 0, 1},
    {BENCH_TOUCH_GBPS, "64 MiB first touch, GB/s", 0, 0},
    {BENCH_TOUCH_FAULTS, "  minor faults, timed", 0, 1},
    {BENCH_TOUCH_PREFAULT_GBPS, "  kvalloc prefault=1, GB/s", 1, 0},
    {BENCH_TOUCH_PREFAULT_FAULTS, "  prefault=1 faults, timed", 1, 1},
};

enum target_state { TARGET_NA, TARGET_PASS, TARGET_FAIL };

struct target {
    const char *name;
    const char *key;
    enum target_state state;
    double value, reference, ratio; /* NAN where they do not apply */
    char detail[192];
};

#define TARGET_COUNT 8

static const char *page_kind_name(double kind)
{
    switch ((int)kind) {
    case KVA_PAGE_KIND_HUGETLB:
        return "hugetlb";
    case KVA_PAGE_KIND_THP:
        return "THP";
    case KVA_PAGE_KIND_SMALL:
        return "small";
    default:
        return "unknown";
    }
}

static void judge_ratio(struct target *t, double kva, double ref, double limit,
                        const char *ref_name)
{
    t->value = kva;
    t->reference = ref;
    if (isnan(kva) || isnan(ref) || ref <= 0) {
        snprintf(t->detail, sizeof t->detail, "n/a (%s not measured)",
                 isnan(kva) ? "kvalloc" : ref_name);
        return;
    }
    t->ratio = kva / ref;
    t->state = t->ratio <= limit ? TARGET_PASS : TARGET_FAIL;
    char a[32], b[32];
    bench_format_figure(a, sizeof a, kva);
    bench_format_figure(b, sizeof b, ref);
    snprintf(t->detail, sizeof t->detail, "%.2fx %s (%s vs %s)", t->ratio, ref_name, a, b);
}

static void judge_targets(const struct syscall_check *sc, struct target *t)
{
    for (int i = 0; i < TARGET_COUNT; i++)
        t[i] = (struct target){NULL, NULL, TARGET_NA, NAN, NAN, NAN, ""};

    int fastest = -1;
    for (int a = 0; a < BENCH_KVALLOC; a++)
        if (!isnan(figure(a, BENCH_BATCH64_NS)) &&
            (fastest < 0 || figure(a, BENCH_BATCH64_NS) < figure(fastest, BENCH_BATCH64_NS)))
            fastest = a;
    t[0].name = "64 B batch <= 1.0x the fastest peer";
    t[0].key = "batch64_vs_fastest_peer";
    judge_ratio(&t[0], figure(BENCH_KVALLOC, BENCH_BATCH64_NS),
                fastest < 0 ? NAN : figure(fastest, BENCH_BATCH64_NS), 1.0,
                fastest < 0 ? "a peer" : bench_allocators[fastest].name);

    t[1].name = "4 KiB batch <= 0.5x tcmalloc";
    t[1].key = "batch4k_vs_tcmalloc";
    judge_ratio(&t[1], figure(BENCH_KVALLOC, BENCH_BATCH4K_NS),
                figure(BENCH_TCMALLOC, BENCH_BATCH4K_NS), 0.5, "tcmalloc");

    t[2].name = "large-block p99 <= tcmalloc's";
    t[2].key = "large_p99_vs_tcmalloc";
    judge_ratio(&t[2], figure(BENCH_KVALLOC, BENCH_LARGE_P99_NS),
                figure(BENCH_TCMALLOC, BENCH_LARGE_P99_NS), 1.0, "tcmalloc");

    t[3].name = "large-block p99.9 < 2000 ns";
    t[3].key = "large_p999_under_2us";
    t[3].value = figure(BENCH_KVALLOC, BENCH_LARGE_P999_NS);
    if (!isnan(t[3].value)) {
        t[3].state = t[3].value < 2000 ? TARGET_PASS : TARGET_FAIL;
        snprintf(t[3].detail, sizeof t[3].detail, "%.0f ns", t[3].value);
    } else {
        snprintf(t[3].detail, sizeof t[3].detail, "n/a (kvalloc not measured)");
    }

    /* Judged at its worst: the pool full of the smallest objects measured. The patterns' own
     * peaks (a few thousand objects live) show the fixed part. */
    t[4].name = "metadata <= 0.5% of capacity";
    t[4].key = "metadata_fraction";
    t[4].value = figure(BENCH_KVALLOC, BENCH_METADATA_FULL_FRACTION);
    if (!isnan(t[4].value)) {
        t[4].state = t[4].value <= 0.005 ? TARGET_PASS : TARGET_FAIL;
        snprintf(t[4].detail, sizeof t[4].detail,
                 "%.3f%% with the pool full; %.3f%% at the patterns' peaks (%.0f B of %.0f MiB)",
                 100 * t[4].value, 100 * figure(BENCH_KVALLOC, BENCH_METADATA_FRACTION),
                 figure(BENCH_KVALLOC, BENCH_METADATA_BYTES),
                 figure(BENCH_KVALLOC, BENCH_CAPACITY) / 1048576);
    } else {
        snprintf(t[4].detail, sizeof t[4].detail, "n/a (kvalloc not measured)");
    }

    t[6].name = "fresh-pool p99 <= tcmalloc's";
    t[6].key = "fresh_p99_vs_tcmalloc";
    judge_ratio(&t[6], figure(BENCH_KVALLOC, BENCH_FRESH_P99_NS),
                figure(BENCH_TCMALLOC, BENCH_FRESH_P99_NS), 1.0, "tcmalloc");

    /* Every timed loop of the allocation patterns, fresh pool included; not the first-touch
     * pass, whose faults at prefault=0 are the managed memory's own first use. */
    static const enum bench_metric timed_faults[] = {BENCH_BATCH64_FAULTS,    BENCH_BATCH4K_FAULTS,
                                                     BENCH_SHUFFLED64_FAULTS, BENCH_MIXED_FAULTS,
                                                     BENCH_LARGE_FAULT_COUNT, BENCH_FRESH_FAULTS};
    t[7].name = "0 minor faults in kvalloc's timed loops";
    t[7].key = "timed_loop_faults";
    double faults = 0;
    unsigned loops = 0;
    for (size_t i = 0; i < sizeof timed_faults / sizeof timed_faults[0]; i++) {
        double f = figure(BENCH_KVALLOC, timed_faults[i]);
        if (!isnan(f)) {
            faults += f;
            loops++;
        }
    }
    if (loops > 0) {
        t[7].value = faults;
        t[7].state = faults == 0 ? TARGET_PASS : TARGET_FAIL;
        snprintf(t[7].detail, sizeof t[7].detail, "%.0f in %u patterns' worst processes", faults,
                 loops);
    } else {
        snprintf(t[7].detail, sizeof t[7].detail, "n/a (kvalloc not measured)");
    }

    t[5].name = "no syscall between pool create/destroy";
    t[5].key = "syscalls_on_alloc_path";
    if (sc->outcome == CHECK_DONE) {
        t[5].value = (double)sc->syscalls;
        t[5].state = sc->syscalls == 0 ? TARGET_PASS : TARGET_FAIL;
        snprintf(t[5].detail, sizeof t[5].detail, "%ld syscalls in %.0f calls", sc->syscalls,
                 figure(BENCH_KVALLOC, BENCH_SYSCALL_CHECK_OPS));
    } else {
        snprintf(t[5].detail, sizeof t[5].detail, "n/a (%s)",
                 sc->outcome == CHECK_SKIPPED ? sc->why_skipped : "not run");
    }
}

static const char *target_word(enum target_state s)
{
    return s == TARGET_PASS ? "PASS" : s == TARGET_FAIL ? "FAIL" : "-";
}

static void print_table(const struct settings *s, const struct machine *m, const struct target *t)
{
    printf("\nbench_alloc: %s, %ld cores, Linux %s\n", m->cpu, m->cores, m->kernel);
    printf("median of %u processes per figure, each measuring after a warm-up (first touch: "
           "%u); batch: %u rounds of 1000 allocs + 1000 frees; large blocks: %u allocations\n",
           s->processes, s->touch_processes, s->rounds, s->samples);
    printf("fresh pool: the first %u allocations of a new pool (kvalloc: 2 GiB), 16 blocks of 1-64 "
           "MiB "
           "live, no warm-up;\nminor faults: in the timed loops, the most any one process took\n",
           s->fresh_samples);
    printf("peers measured through malloc/free (LD_PRELOAD; tcmalloc = gperftools "
           "tcmalloc_minimal); (x) = kvalloc / peer\n\n");

    printf("%-28s", "");
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
        if (s->selected[a])
            printf("%17s", bench_allocators[a].name);
    printf("\n");
    for (size_t r = 0; r < sizeof table_rows / sizeof table_rows[0]; r++) {
        const struct table_row *row = &table_rows[r];
        if (row->kvalloc_only && !s->selected[BENCH_KVALLOC])
            continue;
        printf("%-28s", row->label);
        double kva = figure(BENCH_KVALLOC, row->metric);
        for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++) {
            if (!s->selected[a])
                continue;
            char cell[48], value[32];
            double v = figure(a, row->metric);
            bench_format_figure(value, sizeof value, v);
            if (!g_alloc[a].measured)
                snprintf(cell, sizeof cell, "skipped");
            else if (a != BENCH_KVALLOC && !row->fault_count && !isnan(v) && !isnan(kva) && v > 0)
                snprintf(cell, sizeof cell, "%s (%.2fx)", value, kva / v);
            else
                snprintf(cell, sizeof cell, "%s", value);
            printf("%17s", cell);
        }
        printf("\n");
    }

    if (s->selected[BENCH_KVALLOC]) {
        printf("\nkvalloc pool: %s pages of %.0f KiB; kva_pool_create of 512 MiB: %.2f ms "
               "(prefault=0), %.1f ms (prefault=1)\n",
               page_kind_name(figure(BENCH_KVALLOC, BENCH_PAGE_KIND)),
               figure(BENCH_KVALLOC, BENCH_PAGE_SIZE) / 1024,
               figure(BENCH_KVALLOC, BENCH_CREATE_MS),
               figure(BENCH_KVALLOC, BENCH_CREATE_PREFAULT_MS));
        printf("kvalloc large blocks: %.0f NOMEM retries from fragmentation\n",
               figure(BENCH_KVALLOC, BENCH_LARGE_FAILURES));
    }
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++) {
        if (!isnan(figure(a, BENCH_TIMER_NS))) {
            printf("each large-block sample includes one clock read, about %.0f ns\n",
                   figure(a, BENCH_TIMER_NS));
            break;
        }
    }

    printf("\n%-40s %-36s %s\n", "kvalloc target", "measured", "result");
    for (int i = 0; i < TARGET_COUNT; i++)
        printf("%-40s %-36s %s\n", t[i].name, t[i].detail, target_word(t[i].state));
}

/* ---- JSON ------------------------------------------------------------------------------- */

static void write_json(const struct settings *s, const struct machine *m,
                       const struct syscall_check *sc, const struct target *t)
{
    FILE *f = fopen(s->json_path, "w");
    if (f == NULL)
        bench_die("cannot write %s: %s", s->json_path, strerror(errno));
    fputs("{\n  ", f);
    bench_json_machine(f, m->cpu, m->cores, -1, m->kernel);
    fprintf(f,
            "},\n  \"settings\": {\"quick\": %s, \"rounds\": %u, \"processes\": %u, "
            "\"large_samples\": %u, \"fresh_samples\": %u, \"touch_processes\": %u},\n  "
            "\"allocators\": {",
            s->quick ? "true" : "false", s->rounds, s->processes, s->samples, s->fresh_samples,
            s->touch_processes);
    int first = 1;
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++) {
        if (!s->selected[a])
            continue;
        bench_json_allocator(f, first, (enum bench_allocator)a, &g_alloc[a]);
        first = 0;
        fputs(", \"metrics\": {", f);
        int first_metric = 1;
        for (int k = 0; k < BENCH_METRIC_COUNT; k++) {
            double v = figure(a, k);
            if (isnan(v))
                continue;
            fprintf(f, "%s\"%s\": ", first_metric ? "" : ", ", bench_metric_keys[k]);
            bench_json_number(f, v);
            first_metric = 0;
            /* Where the figure aggregates several processes, their spread goes along. */
            const struct reports *r = &g_reports[a][k];
            if (r->count > 1) {
                fprintf(f, ", \"%s_reports\": [", bench_metric_keys[k]);
                for (unsigned i = 0; i < r->count; i++) {
                    fputs(i ? ", " : "", f);
                    bench_json_number(f, r->value[i]);
                }
                fputs("]", f);
            }
        }
        fputs("}", f);
        if (a != BENCH_KVALLOC) {
            /* kvalloc's figure divided by this peer's, for each row of the table. */
            fputs(", \"kvalloc_over_peer\": {", f);
            int first_ratio = 1;
            for (size_t r = 0; r < sizeof table_rows / sizeof table_rows[0]; r++) {
                double v = figure(a, table_rows[r].metric);
                double kva = figure(BENCH_KVALLOC, table_rows[r].metric);
                if (table_rows[r].fault_count || isnan(v) || isnan(kva) || v <= 0)
                    continue;
                fprintf(f, "%s\"%s\": ", first_ratio ? "" : ", ",
                        bench_metric_keys[table_rows[r].metric]);
                bench_json_number(f, kva / v);
                first_ratio = 0;
            }
            fputs("}", f);
        }
        fputs("}", f);
    }
    fputs("\n  },\n  \"syscall_check\": {\"status\": ", f);
    bench_json_string(f, sc->outcome == CHECK_DONE      ? "done"
                         : sc->outcome == CHECK_SKIPPED ? sc->why_skipped
                                                        : "not run");
    fputs(", \"syscalls_between_markers\": ", f);
    bench_json_number(f, sc->outcome == CHECK_DONE ? (double)sc->syscalls : NAN);
    fputs(", \"allocator_calls\": ", f);
    bench_json_number(f, figure(BENCH_KVALLOC, BENCH_SYSCALL_CHECK_OPS));
    fputs("},\n  \"targets\": [", f);
    for (int i = 0; i < TARGET_COUNT; i++) {
        bench_json_target(f, i == 0, t[i].key, t[i].name,
                          t[i].state == TARGET_PASS   ? "pass"
                          : t[i].state == TARGET_FAIL ? "fail"
                                                      : "n/a",
                          t[i].value, t[i].reference, t[i].ratio);
        fputs("}", f);
    }
    fputs("\n  ]\n}\n", f);
    if (fclose(f) != 0)
        bench_die("cannot write %s", s->json_path);
}

/* ---- main ------------------------------------------------------------------------------- */

/* Every figure is the median over several processes, run in turns across the allocators so
 * that a slow spell of the machine (another build on a 2-core box) is shared by all of them
 * rather than charged to whichever ran during it; the allocator that goes first changes from
 * one repetition to the next, so that no allocator always follows the same one. */
static void run_all(const struct settings *s)
{
    static const char *const in_process_patterns[] = {"batch64", "batch4k", "shuffled64",
                                                      "mixed",   "large",   "fresh"};
    for (unsigned rep = 0; rep < s->processes; rep++)
        for (size_t p = 0; p < sizeof in_process_patterns / sizeof in_process_patterns[0]; p++)
            for (int k = 0; k < BENCH_ALLOCATOR_COUNT; k++) {
                int a = (int)((k + rep) % BENCH_ALLOCATOR_COUNT);
                if (g_alloc[a].measured) {
                    const char *pattern = in_process_patterns[p];
                    struct child_spec c = {(enum bench_allocator)a,
                                           pattern,
                                           0,
                                           NULL,
                                           0,
                                           strcmp(pattern, "fresh") == 0 ? s->fresh_samples : 0};
                    run_measured(s, &c);
                }
            }
    /* In a virtual machine, guest memory nobody has touched since boot (or that was handed
     * back to the host, as free page reporting does) also faults on the host, many times
     * slower, and would be charged to whichever child meets it first. So the first round is
     * dropped, and kvalloc's prefault=1 child runs before its prefault=0 one: the cold memory
     * huge pages may draw on then lands in a pool creation (reported apart), and prefault=0
     * meets memory as warm as the 4 KiB pages the peers reuse. */
    for (unsigned rep = 0; rep <= s->touch_processes; rep++)
        for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
            for (int prefault = a == BENCH_KVALLOC; prefault >= 0; prefault--)
                if (g_alloc[a].measured) {
                    struct child_spec c = {a, "touch", prefault, NULL, rep == 0, 0};
                    run_measured(s, &c);
                }
    bench_progress_done();
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--child") == 0)
        return bench_child_main(argc, argv);

    bench_set_identity("bench_alloc", 1);
    struct settings s;
    parse_options(argc, argv, &s);

    struct syscall_check sc = {CHECK_NOT_RUN, 0, "", ""};
    if (s.syscall_check_only) {
        run_syscall_check(&s, &sc);
        if (sc.outcome != CHECK_DONE) {
            printf("syscall check skipped: %s\n", sc.why_skipped);
            return 77;
        }
        printf("%ld system calls in %.0f kva_alloc/kva_free calls between pool creation and "
               "destruction%s%s\n",
               sc.syscalls, figure(BENCH_KVALLOC, BENCH_SYSCALL_CHECK_OPS), sc.syscalls ? ": " : "",
               sc.first_calls);
        return sc.syscalls == 0 ? 0 : 1;
    }

    struct machine m;
    describe_machine(&m);
    bench_discover_allocators(s.selected, g_alloc);
    run_all(&s);
    if (g_alloc[BENCH_KVALLOC].measured)
        run_syscall_check(&s, &sc);
    if (sc.outcome == CHECK_DONE && sc.syscalls > 0)
        printf("system calls on the kvalloc allocation path: %s\n", sc.first_calls);

    struct target t[TARGET_COUNT];
    judge_targets(&sc, t);
    print_table(&s, &m, t);
    if (s.json_path != NULL) {
        write_json(&s, &m, &sc, t);
        printf("\nwrote %s\n", s.json_path);
    }
    return 0;
}
