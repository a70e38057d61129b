/*
 * fork.h — keeping pools usable in a child process forked while other threads use them
 * (fork.c).
 */
#ifndef KVA_FORK_H
#define KVA_FORK_H

#include "internal.h"

/* A pool joins the fork handlers' list when created and leaves it before it is destroyed. */
void kva_fork_track(kva_pool *pool);
void kva_fork_untrack(kva_pool *pool);

#endif
