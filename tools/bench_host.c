/*
 * bench_host.c — see bench_host.h.
 */
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_host.h"

kva_pool *bench_pool;

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
        if ((size_t)snprintf(path, size, "%s/%s", dirs[i], soname) < size && access(path, R_OK) == 0)
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
            snprintf(why, size, "%s is not in this process (no symbol %s): LD_PRELOAD did not take effect",
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
        snprintf(why, size, "malloc comes from %s, expected %s", info.dli_fname, bench_allocators[want].malloc_owner);
        return why;
    }
    return NULL;
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

void bench_json_target(FILE *f, int first, const char *key, const char *description, const char *result,
                       double value, double reference, double ratio)
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

void bench_discover_allocator(enum bench_allocator a, struct allocator_state *st)
{
    const struct bench_allocator_info *info = &bench_allocators[a];
    if (a == BENCH_KVALLOC)
        snprintf(st->version, sizeof st->version, "%d.%d.%d (this tree)", KVA_VERSION_MAJOR, KVA_VERSION_MINOR,
                 KVA_VERSION_PATCH);
    else
        bench_package_version(info->package, st->version, sizeof st->version);
    if (info->soname == NULL) {
        snprintf(st->library, sizeof st->library, "%s", a == BENCH_KVALLOC ? "libkvalloc (linked)" : "libc (no preload)");
        st->measured = 1;
    } else if (bench_find_library(info->soname, st->library, sizeof st->library)) {
        st->measured = 1;
    } else {
        snprintf(st->skip_reason, sizeof st->skip_reason, "%s not found (Debian package %s)", info->soname,
                 info->package);
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

void bench_json_allocator(FILE *f, int first, enum bench_allocator a, const struct allocator_state *st)
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

int bench_spawn_child(const char *tool, enum bench_allocator a, const struct allocator_state *st,
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
        fprintf(stderr, "%s: cannot run %s: %s\n", tool, argv[0], strerror(errno));
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
