/*
 * bench_host.c — see bench_host.h.
 */
#include <dlfcn.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_host.h"

kva_pool *bench_pool;

static void *malloc_alloc(size_t size) { return malloc(size); }

static int malloc_release(void *ptr)
{
    free(ptr);
    return 0;
}

/* ptr needs no initial value: kva_alloc writes it exactly when it returns KVA_OK. */
static void *kvalloc_alloc(size_t size)
{
    void *ptr;
    return kva_alloc(bench_pool, size, &ptr) == KVA_OK ? ptr : NULL;
}

static int kvalloc_release(void *ptr) { return kva_free(bench_pool, ptr) != KVA_OK; }

const struct backend bench_malloc_backend = {malloc_alloc, malloc_release};
const struct backend bench_kvalloc_backend = {kvalloc_alloc, kvalloc_release};

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
