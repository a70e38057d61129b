/*
 * os_fork.c — the fork depth (os.h): how many forks lie between the process that loaded the
 * library and this one.
 */
#include "os.h"

static unsigned fork_depth; /* only kva_os_fork_child writes it, in a process of one thread */

unsigned kva_os_fork_depth(void) { return fork_depth; }

void kva_os_fork_child(void) { fork_depth++; }
