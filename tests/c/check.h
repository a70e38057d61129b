/*
 * check.h — the tests' only framework: CHECK reports the failing expression with its location
 * and makes the test exit nonzero at the end, so one run shows every failure.
 */
#ifndef KVA_TEST_CHECK_H
#define KVA_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "kvalloc.h" /* the macros print kva_strerror and kva_last_error */

static int check_failures;

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);         \
            check_failures++;                                                                \
        }                                                                                    \
    } while (0)

/* A status check that prints the library's description when it fails. */
#define CHECK_STATUS(expr, expected)                                                         \
    do {                                                                                     \
        kva_status check_got_ = (expr);                                                      \
        if (check_got_ != (expected)) {                                                      \
            fprintf(stderr, "%s:%d: %s returned %d (%s: %s), expected %d\n", __FILE__,       \
                    __LINE__, #expr, (int)check_got_, kva_strerror(check_got_),              \
                    kva_last_error(), (int)(expected));                                      \
            check_failures++;                                                                \
        }                                                                                    \
    } while (0)

/* Stops the test at once: for failures that make everything after them meaningless. */
#define REQUIRE(cond)                                                                        \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: REQUIRE failed: %s (%s)\n", __FILE__, __LINE__, #cond,   \
                    kva_last_error());                                                       \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

#define CHECK_DONE()                                                                         \
    (check_failures ? (fprintf(stderr, "%d check(s) failed\n", check_failures), 1) : 0)

#endif
