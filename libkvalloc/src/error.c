/*
 * error.c — status names and the per-thread description of the last failure.
 */
#include <stdarg.h>
#include <stdio.h>

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
