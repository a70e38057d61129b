/*
 * bench_host.c — see bench_host.h.
 */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_clock.h"
#include "bench_host.h"

kva_pool *bench_pool;

static const char *g_name = "bench";
static int g_die_status = 2;

void bench_set_identity(const char *name, int die_status)
{
    g_name = name;
    g_die_status = die_status;
}

void bench_die(const char *fmt, ...)
{
    va_list ap;
    fflush(stdout);
    fprintf(stderr, "%s: ", g_name);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    _exit(g_die_status);
}

void *bench_xmalloc(size_t size)
{
    void *p = malloc(size);
    if (p == NULL)
        bench_die("out of memory for %zu bytes of bookkeeping", size);
    return p;
}

void *bench_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size);
    if (p == NULL)
        bench_die("out of memory for %zu bytes of bookkeeping", n * size);
    return p;
}

unsigned bench_parse_count(const char *flag, const char *text, unsigned long max)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(text, &end, 10);
    if (*text == '\0' || *end != '\0' || errno != 0 || v == 0 || v > max)
        bench_die("%s wants a count between 1 and %lu, not '%s'", flag, max, text);
    return (unsigned)v;
}

const struct backend bench_malloc_backend = {malloc, free, NULL, NULL};
const struct backend bench_kvalloc_backend = {NULL, NULL, kva_alloc, kva_free};

void bench_trim_newline(char *text) { text[strcspn(text, "\n")] = '\0'; }

void bench_package_version(const char *package, char *out, size_t size)
{
    char command[160];
    snprintf(out, size, "unknown");
    snprintf(command, sizeof command, "dpkg-query -W -f='${Version}' %s 2>/dev/null", package);
    FILE *p = popen(command, "r");
    if (p == NULL)
        return;
    char line[64];
    if (fgets(line, sizeof line, p) != NULL && line[0] != '\0') {
        bench_trim_newline(line);
        snprintf(out, size, "%s", line);
    }
    pclose(p);
}

int bench_find_library(const char *soname, char *path, size_t size)
{
    char libc_dir[PATH_MAX] = "/usr/lib";
    Dl_info info;
    void *libc_sym = dlsym(RTLD_DEFAULT, "gnu_get_libc_version");
    if (libc_sym != NULL && dladdr(libc_sym, &info) != 0 && info.dli_fname != NULL) {
        snprintf(libc_dir, sizeof libc_dir, "%s", info.dli_fname);
        char *slash = strrchr(libc_dir, '/');
        if (slash != NULL)
            *slash = '\0';
    }
    char usr_libc_dir[PATH_MAX + 4];
    snprintf(usr_libc_dir, sizeof usr_libc_dir, "/usr%s", libc_dir);
    const char *dirs[] = {libc_dir, usr_libc_dir, "/usr/local/lib", "/usr/lib64", "/usr/lib"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++)
        if ((size_t)snprintf(path, size, "%s/%s", dirs[i], soname) < size &&
            access(path, R_OK) == 0)
            return 1;
    return 0;
}

const char *bench_preload_problem(enum bench_allocator want, char *why, size_t size)
{
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++) {
        const char *marker = bench_allocators[a].marker_symbol;
        if (marker == NULL)
            continue;
        int present = dlsym(RTLD_DEFAULT, marker) != NULL;
        if (a == (int)want && !present) {
            snprintf(why, size,
                     "%s is not in this process (no symbol %s): LD_PRELOAD did not take effect",
                     bench_allocators[a].name, marker);
            return why;
        }
        if (a != (int)want && present) {
            snprintf(why, size, "%s is loaded (symbol %s) but %s was asked for: stray LD_PRELOAD?",
                     bench_allocators[a].name, marker, bench_allocators[want].name);
            return why;
        }
    }
    Dl_info info;
    void *malloc_sym = dlsym(RTLD_DEFAULT, "malloc");
    if (malloc_sym == NULL || dladdr(malloc_sym, &info) == 0 || info.dli_fname == NULL)
        return "cannot tell which object defines malloc";
    if (strstr(info.dli_fname, bench_allocators[want].malloc_owner) == NULL) {
        snprintf(why, size, "malloc comes from %s, expected %s", info.dli_fname,
                 bench_allocators[want].malloc_owner);
        return why;
    }
    return NULL;
}

void bench_verify_allocator(enum bench_allocator want)
{
    char why[4096 + 160];
    const char *problem = bench_preload_problem(want, why, sizeof why);
    if (problem != NULL)
        bench_die("%s", problem);
}

void bench_report(const char *allocator, const char *metric, double value)
{
    printf("{\"allocator\":\"%s\",\"metric\":\"%s\",\"value\":%.15g}\n", allocator, metric, value);
}

void bench_json_string(FILE *f, const char *text)
{
    fputc('"', f);
    for (const unsigned char *c = (const unsigned char *)text; *c != '\0'; c++) {
        if (*c == '"' || *c == '\\')
            fprintf(f, "\\%c", *c);
        else if (*c < 0x20)
            fprintf(f, "\\u%04x", *c);
        else
            fputc(*c, f);
    }
    fputc('"', f);
}

void bench_json_number(FILE *f, double v)
{
    if (isnan(v) || isinf(v))
        fputs("null", f);
    else
        fprintf(f, "%.15g", v);
}

void bench_json_target(FILE *f, int first, const char *key, const char *description,
                       const char *result, double value, double reference, double ratio)
{
    fprintf(f, "%s\n    {\"name\": ", first ? "" : ",");
    bench_json_string(f, key);
    fputs(", \"description\": ", f);
    bench_json_string(f, description);
    fprintf(f, ", \"result\": \"%s\", \"value\": ", result);
    bench_json_number(f, value);
    fputs(", \"reference\": ", f);
    bench_json_number(f, reference);
    fputs(", \"ratio\": ", f);
    bench_json_number(f, ratio);
}

void bench_select_allocators(const char *list, int selected[BENCH_ALLOCATOR_COUNT])
{
    char copy[256];
    if (strlen(list) >= sizeof copy)
        bench_die("--only list too long");
    strcpy(copy, list);
    memset(selected, 0, BENCH_ALLOCATOR_COUNT * sizeof *selected);
    for (char *save = NULL, *name = strtok_r(copy, ",", &save); name != NULL;
         name = strtok_r(NULL, ",", &save)) {
        int found = 0;
        for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
            if (strcmp(name, bench_allocators[a].name) == 0)
                selected[a] = found = 1;
        if (!found)
            bench_die("unknown allocator '%s' (glibc jemalloc mimalloc tcmalloc kvalloc)", name);
    }
}

void bench_discover_allocators(const int selected[BENCH_ALLOCATOR_COUNT],
                               struct allocator_state st[BENCH_ALLOCATOR_COUNT])
{
    for (int a = 0; a < BENCH_ALLOCATOR_COUNT; a++)
        if (selected[a])
            bench_discover_allocator((enum bench_allocator)a, &st[a]);
}

void bench_discover_allocator(enum bench_allocator a, struct allocator_state *st)
{
    const struct bench_allocator_info *info = &bench_allocators[a];
    if (a == BENCH_KVALLOC)
        snprintf(st->version, sizeof st->version, "%d.%d.%d (this tree)", KVA_VERSION_MAJOR,
                 KVA_VERSION_MINOR, KVA_VERSION_PATCH);
    else
        bench_package_version(info->package, st->version, sizeof st->version);
    if (info->soname == NULL) {
        snprintf(st->library, sizeof st->library, "%s",
                 a == BENCH_KVALLOC ? "libkvalloc (linked)" : "libc (no preload)");
        st->measured = 1;
    } else if (bench_find_library(info->soname, st->library, sizeof st->library)) {
        st->measured = 1;
    } else {
        snprintf(st->skip_reason, sizeof st->skip_reason, "%s not found (Debian package %s)",
                 info->soname, info->package);
        printf("skipping %s: %s\n", info->name, st->skip_reason);
    }
}

void bench_describe_host(char *cpu, size_t cpu_size, long *cores, char *kernel, size_t kernel_size)
{
    snprintf(cpu, cpu_size, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f != NULL && fgets(line, sizeof line, f) != NULL) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon != NULL) {
            bench_trim_newline(colon);
            snprintf(cpu, cpu_size, "%s", colon + 1 + (colon[1] == ' '));
            break;
        }
    }
    if (f != NULL)
        fclose(f);
    *cores = sysconf(_SC_NPROCESSORS_ONLN);
    struct utsname u;
    snprintf(kernel, kernel_size, "%s", uname(&u) == 0 ? u.release : "unknown");
}

void bench_json_allocator(FILE *f, int first, enum bench_allocator a,
                          const struct allocator_state *st)
{
    fprintf(f, "%s\n    ", first ? "" : ",");
    bench_json_string(f, bench_allocators[a].name);
    fputs(": {\"status\": ", f);
    bench_json_string(f, st->measured ? "measured" : st->skip_reason);
    fputs(", \"library\": ", f);
    bench_json_string(f, st->library);
    fputs(", \"version\": ", f);
    bench_json_string(f, st->version);
}

long bench_usable_cpus(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? n : 1;
}

double bench_cpu_seconds(const struct rusage *u)
{
    return (double)u->ru_utime.tv_sec + (double)u->ru_utime.tv_usec / 1e6 +
           (double)u->ru_stime.tv_sec + (double)u->ru_stime.tv_usec / 1e6;
}

/* Machine-wide busy (user, nice, system, irq, softirq) and steal time from /proc/stat, in
 * seconds, and this process's own; 0 if any cannot be read. */
static int sample_load(struct bench_load *l)
{
    unsigned long long v[8];
    FILE *f = fopen("/proc/stat", "r");
    if (f == NULL)
        return 0;
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                   &v[4], &v[5], &v[6], &v[7]);
    fclose(f);
    double tick = (double)sysconf(_SC_CLK_TCK);
    struct rusage self;
    if (n != 8 || tick <= 0 || getrusage(RUSAGE_SELF, &self) != 0)
        return 0;
    l->busy_s = (double)(v[0] + v[1] + v[2] + v[5] + v[6]) / tick;
    l->steal_s = (double)v[7] / tick;
    l->wall_ns = bench_now_ns();
    l->self_s = bench_cpu_seconds(&self);
    return 1;
}

void bench_load_begin(struct bench_load *at) { at->sampled = sample_load(at); }

void bench_load_end(const struct bench_load *at, double children_cpu_s, double *others_cores,
                    double *steal_cores)
{
    struct bench_load now;
    *others_cores = *steal_cores = NAN;
    if (!at->sampled || !sample_load(&now) || now.wall_ns <= at->wall_ns)
        return;
    double wall_s = (now.wall_ns - at->wall_ns) / 1e9;
    double others = now.busy_s - at->busy_s - children_cpu_s - (now.self_s - at->self_s);
    *others_cores = (others > 0 ? others : 0) / wall_s;
    *steal_cores = (now.steal_s - at->steal_s) / wall_s;
}

/* Starts argv (argv[0] a path, or a program found on PATH) with allocator a preloaded
 * (st->library; none for glibc and kvalloc), its standard output into a pipe: returns the
 * child's pid and the pipe's read end in *out, or -1 with errno. The caller must be
 * single-threaded (setenv after fork). */
static int spawn_child(enum bench_allocator a, const struct allocator_state *st,
                       const char *const *argv, FILE **out)
{
    int fds[2];
    if (pipe(fds) != 0)
        return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        int saved = errno;
        close(fds[0]);
        close(fds[1]);
        errno = saved;
        return -1;
    }
    if (pid == 0) {
        dup2(fds[1], STDOUT_FILENO);
        close(fds[0]);
        close(fds[1]);
        if (bench_allocators[a].soname != NULL)
            setenv("LD_PRELOAD", st->library, 1);
        else
            unsetenv("LD_PRELOAD");
        execvp(argv[0], (char *const *)argv); /* a path, or a program on PATH (strace) */
        fprintf(stderr, "%s: cannot run %s: %s\n", g_name, argv[0], strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    *out = fdopen(fds[0], "r");
    if (*out == NULL) {
        int saved = errno;
        close(fds[0]);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        errno = saved;
        return -1;
    }
    return pid;
}

const char *bench_self_path(void)
{
    static char path[PATH_MAX];
    if (path[0] == '\0') {
        ssize_t len = readlink("/proc/self/exe", path, sizeof path - 1);
        if (len <= 0)
            bench_die("cannot find this executable: %s", strerror(errno));
        path[len] = '\0';
    }
    return path;
}

int bench_run_child(enum bench_allocator a, const struct allocator_state *st,
                    const char *const *argv, bench_report_fn *fn, void *ctx, struct rusage *usage)
{
    FILE *in;
    pid_t pid = spawn_child(a, st, argv, &in);
    if (pid < 0)
        bench_die("starting a child: %s", strerror(errno));
    char line[512];
    while (fgets(line, sizeof line, in) != NULL) {
        char name[32], key[48];
        double value;
        if (line[0] != '{')
            continue;
        if (sscanf(line, "{\"allocator\":\"%31[^\"]\",\"metric\":\"%47[^\"]\",\"value\":%lf}", name,
                   key, &value) != 3)
            bench_die("unreadable report from a child: %s", line);
        if (strcmp(name, bench_allocators[a].name) != 0)
            bench_die("a child for %s reported as %s", bench_allocators[a].name, name);
        if (fn != NULL)
            fn(ctx, key, value);
    }
    fclose(in);
    int status;
    struct rusage own;
    while (wait4(pid, &status, 0, usage != NULL ? usage : &own) < 0)
        if (errno != EINTR)
            bench_die("wait4: %s", strerror(errno));
    return status;
}

void bench_progress(const char *fmt, ...)
{
    if (!isatty(STDERR_FILENO))
        return;
    va_list ap;
    fputc('\r', stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}

void bench_progress_done(void)
{
    if (isatty(STDERR_FILENO))
        fprintf(stderr, "\r%60s\r", "");
}

void bench_format_figure(char *out, size_t size, double v)
{
    if (isnan(v))
        snprintf(out, size, "-");
    else if (v >= 100)
        snprintf(out, size, "%.0f", v);
    else if (v >= 10)
        snprintf(out, size, "%.1f", v);
    else
        snprintf(out, size, "%.2f", v);
}

/* Appends text to out (size bytes, used so far); text that does not fit is cut. */
static void append(char *out, size_t size, size_t *used, const char *text)
{
    size_t room = size - 1 - *used, len = strlen(text);
    len = len < room ? len : room;
    memcpy(out + *used, text, len);
    *used += len;
    out[*used] = '\0';
}

void bench_json_command(FILE *f, int argc, char **argv)
{
    static const char plain_chars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                      "0123456789_./,=:+-@%";
    static char out[4096];
    size_t used = 0;
    out[0] = '\0';
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        append(out, sizeof out, &used, i ? " " : "");
        if (*arg != '\0' && strspn(arg, plain_chars) == strlen(arg)) {
            append(out, sizeof out, &used, arg);
            continue;
        }
        append(out, sizeof out, &used, "'");
        for (const char *c = arg; *c != '\0'; c++) {
            char one[2] = {*c, '\0'};
            append(out, sizeof out, &used, *c == '\'' ? "'\\''" : one);
        }
        append(out, sizeof out, &used, "'");
    }
    bench_json_string(f, out);
}

void bench_json_machine(FILE *f, const char *cpu, long cores, long usable, const char *kernel)
{
    fputs("\"machine\": {\"cpu\": ", f);
    bench_json_string(f, cpu);
    fprintf(f, ", \"cores\": %ld", cores);
    if (usable >= 0)
        fprintf(f, ", \"usable_cpus\": %ld", usable);
    fputs(", \"kernel\": ", f);
    bench_json_string(f, kernel);
}
