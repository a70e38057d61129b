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

#endif
