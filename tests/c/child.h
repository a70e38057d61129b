/*
 * child.h — running part of a test in a child process, for steps that change what the process
 * may do (limits, capabilities, THP, mount namespaces), which the rest of the run must not
 * inherit, or that may end in a signal the test must see rather than die of.
 */
#ifndef KVA_TEST_CHILD_H
#define KVA_TEST_CHILD_H

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

/* Runs fn in a child process and reports its verdict: 0 passed, 77 skipped (the child said
 * why), anything else, a signal included, failed. */
static __attribute__((unused)) void in_child(int (*fn)(void), const char *name) {
    fflush(stderr);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        check_failures = 0; /* the child's verdict is its own, not the parent's failures so far */
        _exit(fn());
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) return;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "%s: the child failed (status %#x)\n", name, status);
        check_failures++;
    }
}

#endif
