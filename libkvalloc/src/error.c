/*
 * error.c — status names, the per-thread description of the last failure, and what a failed
 * assertion of a debug build does (internal.h).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* One buffer per thread: a failing call in one thread never garbles another's message. */
static _Thread_local char last_error[256];

const char *kva_strerror(kva_status status) {
    switch (status) {
    case KVA_OK: return "success";
    case KVA_ERR_NOMEM: return "out of memory in the pool";
    case KVA_ERR_INVALID: return "invalid argument";
    case KVA_ERR_DOUBLE_FREE: return "double free";
    case KVA_ERR_BAD_POINTER: return "pointer not allocated by this pool";
    case KVA_ERR_BACKEND: return "backing memory unavailable";
    case KVA_ERR_CORRUPT: return "pool metadata corrupted";
    }
    return "unknown status";
}

const char *kva_last_error(void) { return last_error; }

kva_status kva_fail(kva_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
    return status;
}

#if KVA_DEBUG >= 1
/* The checker an expensive assertion runs names what it found broken in the last error. */
void kva_assert_fail(const char *expr, const char *file, int line, const char *func) {
    fprintf(stderr, "%s:%d: %s: libkvalloc assertion failed: %s\n", file, line, func, expr);
    if (last_error[0]) fprintf(stderr, "  the thread's last error: %s\n", last_error);
    fflush(stderr);
    abort();
}
#endif

#if KVA_DEBUG >= 3
int kva_debug_expensive;

__attribute__((constructor)) static void read_debug_expensive(void) {
    const char *v = getenv("KVA_DEBUG_EXPENSIVE");
    kva_debug_expensive = v && strcmp(v, "1") == 0;
}
#endif
