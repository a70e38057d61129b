/*
 * check.h — the tests' only framework: CHECK reports the failing expression with its location
 * and makes the test exit nonzero at the end, so one run shows every failure.
 */
#ifndef KVA_TEST_CHECK_H
#define KVA_TEST_CHECK_H

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvalloc.h" /* the macros print kva_strerror and kva_last_error */

static int check_failures;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            check_failures++;                                                        \
        }                                                                            \
    } while (0)

/* A status check that prints the library's description when it fails. */
#define CHECK_STATUS(expr, expected)                                                                    \
    do {                                                                                                \
        kva_status check_got_ = (expr);                                                                 \
        if (check_got_ != (expected)) {                                                                 \
            fprintf(stderr, "%s:%d: %s returned %d (%s: %s), expected %d\n", __FILE__, __LINE__, #expr, \
                    (int)check_got_, kva_strerror(check_got_), kva_last_error(), (int)(expected));      \
            check_failures++;                                                                           \
        }                                                                                               \
    } while (0)

/* Stops the test at once: for failures that make everything after them meaningless. */
#define REQUIRE(cond)                                                                                         \
    do {                                                                                                      \
        if (!(cond)) {                                                                                        \
            fprintf(stderr, "%s:%d: REQUIRE failed: %s (%s)\n", __FILE__, __LINE__, #cond, kva_last_error()); \
            exit(1);                                                                                          \
        }                                                                                                     \
    } while (0)

/* A bound against a hang, never a measure of speed: generous, so that a loaded machine with
 * sanitizers never reaches it. */
#define HANG_GUARD_SECONDS 60

static __attribute__((unused)) char hang_guard_message[256];

static __attribute__((unused)) void hang_guard_fired(int sig) {
    (void)sig;
    ssize_t written = write(2, hang_guard_message, strlen(hang_guard_message));
    (void)written; /* the exit status says it failed either way */
    _exit(1);
}

/* Fails the calling process, saying that `what` hung, once `seconds` have passed (SIGALRM):
 * exit status 1, which a parent waiting for the process reads as a failure. */
static __attribute__((unused)) void hang_guard(const char *what, unsigned seconds) {
    snprintf(hang_guard_message, sizeof hang_guard_message, "hung: %s did not finish within %u s\n", what, seconds);
    signal(SIGALRM, hang_guard_fired);
    alarm(seconds);
}

#define CHECK_DONE() (check_failures ? (fprintf(stderr, "%d check(s) failed\n", check_failures), 1) : 0)

#endif
