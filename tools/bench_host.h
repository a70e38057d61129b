/*
 * bench_host.h — the harness bench_alloc and bench_threads share, so that each tool is its own
 * patterns, tables and targets: dying with a tool's name, the child's side of bench_protocol.h
 * (the preload check, report lines), the parent's (choosing and finding the allocators, running
 * a child and reading its reports, progress on a terminal), the machine and the other load on
 * it while children run, and JSON.
 */
#ifndef KVA_BENCH_HOST_H
#define KVA_BENCH_HOST_H

#include <stddef.h>
#include <stdio.h>
#include <sys/resource.h>

#include "bench_protocol.h"
#include "kvalloc.h"

/* ---- dying, and what every tool needs first -------------------------------------------- */

/* The name a tool's messages start with ("bench_alloc", "bench_threads --child kvalloc") and the
 * status it exits with when it dies: 1 for a parent, 2 for a child (whose parent then stops and
 * says which child failed). Until set: "bench" and 2. */
void bench_set_identity(const char *name, int die_status);

/* Prints "name: message" on stderr and exits with that status at once: _exit, since a child may
 * die on a worker thread while others are inside the allocator (standard output is flushed
 * first). */
void bench_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* Host memory for bookkeeping, or death. */
void *bench_xmalloc(size_t size);
void *bench_xcalloc(size_t n, size_t size);

/* An option's count, 1 .. max, or death naming the flag. */
unsigned bench_parse_count(const char *flag, const char *text, unsigned long max);

/* The allocator under test, behind function pointers chosen at run time, so that the compiler
 * can neither elide nor merge malloc/free pairs it can see through. They are the allocator's own
 * entry points, called with nothing in between, as an engine calls them: malloc_fn and free_fn
 * for a malloc-shaped allocator, kva_alloc_fn and kva_free_fn (on bench_pool) for kvalloc; the
 * other pair is NULL. Each call is one indirect call into the real entry point. A wrapper of one
 * shape for all, void *(size_t), would cost them unequally: kva_alloc's out-pointer would make
 * kvalloc's a call frame with a stack round trip where malloc's is a jump, and a free wrapper
 * is a call frame that a short free feels more than a long one. */
struct backend {
    void *(*malloc_fn)(size_t size);
    void (*free_fn)(void *ptr);
    kva_status (*kva_alloc_fn)(kva_pool *pool, size_t size, void **out);
    kva_status (*kva_free_fn)(kva_pool *pool, void *ptr);
};

/* malloc/free (a peer under LD_PRELOAD, or glibc), and kva_alloc/kva_free on bench_pool. */
extern kva_pool *bench_pool;
extern const struct backend bench_malloc_backend, bench_kvalloc_backend;

/* One allocation into *slot through the allocator's own entry point; nonzero if it failed. A
 * loop that can hoist the choice of entry point (bench_child's batch) does so instead. */
static inline int bench_alloc_into(const struct backend *b, size_t size, void **slot)
{
    if (b->kva_alloc_fn != NULL)
        return b->kva_alloc_fn(bench_pool, size, slot) != KVA_OK;
    return (*slot = b->malloc_fn(size)) == NULL;
}

/* One free through the allocator's own entry point; nonzero if it was refused. */
static inline int bench_release(const struct backend *b, void *ptr)
{
    if (b->kva_free_fn != NULL)
        return b->kva_free_fn(bench_pool, ptr) != KVA_OK;
    b->free_fn(ptr);
    return 0;
}

/* What was found of one allocator: whether it can be measured (its library is there), what is
 * preloaded (the libc path for glibc, "linked" for kvalloc), why not, and its version. */
struct allocator_state {
    int measured;
    char library[4096];
    char skip_reason[160];
    char version[64];
};

/* ---- the child's side of bench_protocol.h ---------------------------------------------- */

/* Dies unless the preload took effect (bench_preload_problem). */
void bench_verify_allocator(enum bench_allocator want);

/* One report on stdout, in bench_protocol.h's line format. */
void bench_report(const char *allocator, const char *metric, double value);

/* ---- the parent's side ----------------------------------------------------------------- */

/* The allocators a comma-separated list names (--only) in selected[], the others 0; dies on a
 * name it does not know. */
void bench_select_allocators(const char *list, int selected[BENCH_ALLOCATOR_COUNT]);

/* Fills st for allocator a, and says on stdout when it must be skipped. */
void bench_discover_allocator(enum bench_allocator a, struct allocator_state *st);

/* The same for every selected allocator. */
void bench_discover_allocators(const int selected[BENCH_ALLOCATOR_COUNT],
                               struct allocator_state st[BENCH_ALLOCATOR_COUNT]);

/* This executable's path, which a parent starts its children from (/proc/self/exe); death if
 * it cannot be read. */
const char *bench_self_path(void);

/* What a parent does with one report of a child: metric and value. */
typedef void bench_report_fn(void *ctx, const char *metric, double value);

/* Runs argv as allocator a's child (bench_spawn_child) and hands each of its reports to fn (to
 * none when fn is NULL); a line that does not start with '{' is not a report, and a report that
 * cannot be read or names another allocator is fatal. Returns the child's wait status, its
 * resource usage in *usage when not NULL. Any failure to run it is fatal too: a partial
 * comparison would read as a complete one. */
int bench_run_child(enum bench_allocator a, const struct allocator_state *st,
                    const char *const *argv, bench_report_fn *fn, void *ctx, struct rusage *usage);

/* What is running, on a terminal's stderr, on one line the next call overwrites; nothing when
 * stderr is not a terminal. bench_progress_done clears the line. */
void bench_progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void bench_progress_done(void);

/* A figure for a table's cell: "-" for NaN, more digits for small values. */
void bench_format_figure(char *out, size_t size, double v);

/* ---- the machine ----------------------------------------------------------------------- */

/* The CPU model (from /proc/cpuinfo), the online CPUs and the kernel release. */
void bench_describe_host(char *cpu, size_t cpu_size, long *cores, char *kernel, size_t kernel_size);

/* The CPUs this process may run on (what nproc prints). */
long bench_usable_cpus(void);

/* The machine's CPU time (/proc/stat) and this process's, at the start of a run. */
struct bench_load {
    int sampled;
    double busy_s, steal_s, wall_ns, self_s;
};
void bench_load_begin(struct bench_load *at);

/* User and system time of a process's resource usage, in seconds. */
double bench_cpu_seconds(const struct rusage *usage);

/* CPU time others took since bench_load_begin, as average cores: other processes (less the
 * children's time, children_cpu_s, and this process's own) and the hypervisor (steal). NAN where
 * /proc/stat cannot be read. Whatever else runs takes cores from the threads measured. */
void bench_load_end(const struct bench_load *at, double children_cpu_s, double *others_cores,
                    double *steal_cores);

/* Cuts text at its first newline. */
void bench_trim_newline(char *text);

/* The version of a Debian package, or "unknown" on a machine without dpkg. */
void bench_package_version(const char *package, char *out, size_t size);

/* The path of soname: beside the running libc first ("/lib/x86_64-linux-gnu" on Debian, where
 * the distribution's other libraries live too), then the usual prefixes. 0 if not found. */
int bench_find_library(const char *soname, char *path, size_t size);

/* A run with a preload that silently did not apply would measure glibc under another name: the
 * wanted allocator's own symbol must be present (and no other peer's), and malloc must come from
 * the expected object. NULL if so, else why not (a static string or one written to why). */
const char *bench_preload_problem(enum bench_allocator want, char *why, size_t size);

/* ---- JSON ------------------------------------------------------------------------------ */

/* JSON: a string with its escapes; a number, or null for NaN and infinities. */
void bench_json_string(FILE *f, const char *text);
void bench_json_number(FILE *f, double v);

/* The command line as a string a shell would take back: arguments quoted where they need it. */
void bench_json_command(FILE *f, int argc, char **argv);

/* "machine": {"cpu": ..., "cores": ..., "usable_cpus": ... (when usable >= 0), "kernel": ...,
 * its closing brace left to the caller (which may add fields). */
void bench_json_machine(FILE *f, const char *cpu, long cores, long usable, const char *kernel);

/* One allocator of the "allocators" object, its closing brace left to the caller (which adds
 * its figures): "name": {"status": ..., "library": ..., "version": ... */
void bench_json_allocator(FILE *f, int first, enum bench_allocator a,
                          const struct allocator_state *st);

/* One target of the "targets" array, its closing brace left to the caller (which may add
 * fields): {"name": key, "description": ..., "result": ..., "value": ..., "reference": ...,
 * "ratio": ... */
void bench_json_target(FILE *f, int first, const char *key, const char *description,
                       const char *result, double value, double reference, double ratio);

#endif
