/*
 * bench_host.h — what bench_alloc and bench_threads both need from the machine around them:
 * finding a peer allocator's library and its package version, checking in a child that the
 * preload took effect, and writing JSON values.
 */
#ifndef KVA_BENCH_HOST_H
#define KVA_BENCH_HOST_H

#include <stddef.h>
#include <stdio.h>

#include "bench_protocol.h"
#include "kvalloc.h"

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

/* Fills st for allocator a, and says on stdout when it must be skipped. */
void bench_discover_allocator(enum bench_allocator a, struct allocator_state *st);

/* The CPU model (from /proc/cpuinfo), the online CPUs and the kernel release. */
void bench_describe_host(char *cpu, size_t cpu_size, long *cores, char *kernel, size_t kernel_size);

/* Starts argv (argv[0] a path, or a program found on PATH) with allocator a preloaded (st->library; none for
 * glibc and kvalloc), its standard output into a pipe: returns the child's pid and the pipe's
 * read end in *out, or -1 with errno. The caller must be single-threaded (setenv after fork). */
int bench_spawn_child(const char *tool, enum bench_allocator a, const struct allocator_state *st,
                      const char *const *argv, FILE **out);

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

/* JSON: a string with its escapes; a number, or null for NaN and infinities. */
void bench_json_string(FILE *f, const char *text);
void bench_json_number(FILE *f, double v);

/* One allocator of the "allocators" object, its closing brace left to the caller (which adds
 * its figures): "name": {"status": ..., "library": ..., "version": ... */
void bench_json_allocator(FILE *f, int first, enum bench_allocator a, const struct allocator_state *st);

/* One target of the "targets" array, its closing brace left to the caller (which may add
 * fields): {"name": key, "description": ..., "result": ..., "value": ..., "reference": ...,
 * "ratio": ... */
void bench_json_target(FILE *f, int first, const char *key, const char *description, const char *result,
                       double value, double reference, double ratio);

#endif
