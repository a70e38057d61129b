/*
 * numa.h — binding host memory to a NUMA node through the raw system calls of os.h: no libnuma,
 * so the library builds and runs where it is not installed.
 */
#ifndef KVA_NUMA_H
#define KVA_NUMA_H

#include <stddef.h>

#include "internal.h"

/* Node ids the masks here can hold; Linux's MAX_NUMNODES is at most 1024. */
#define KVA_NUMA_MAX_NODES 4096

/* KVA_OK if this process may take memory from node; otherwise KVA_ERR_INVALID saying whether
 * the node does not exist or the process's cpuset excludes it, and which nodes it may use. */
kva_status kva_numa_check_node(int node);

/* Sets the policy of [addr, addr+length), which nobody has touched yet: its pages will come
 * only from node (KVA_NUMA_BIND) or from node while it has free memory (KVA_NUMA_PREFERRED). */
kva_status kva_numa_bind(void *addr, size_t length, int node, kva_numa_policy policy);

/* The nodes this process may take memory from, and the node of a CPU (-1 if unknown). */
unsigned kva_numa_allowed_count(void);
int kva_numa_node_of_cpu(unsigned cpu);

/* Whether a host pool's arenas bind their slabs to their CPUs' nodes: with several nodes, or
 * when a test forces it (kva_numa_test_force_arenas: then every CPU counts as being on the
 * first node the process may use, so a one-node machine exercises the binding). */
int kva_numa_arenas_wanted(void);
void kva_numa_test_force_arenas(int force);

#endif
