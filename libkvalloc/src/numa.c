/*
 * numa.c — NUMA placement of a pool's host region (numa.h).
 */
#include <stdio.h>
#include <string.h>

#include "numa.h"
#include "os.h"

/* The kernel's values (linux/mempolicy.h), spelled here so no NUMA header is needed to build. */
#define MPOL_PREFERRED 1
#define MPOL_BIND 2
#define MPOL_F_MEMS_ALLOWED 4

#define LONG_BITS (8 * sizeof(unsigned long))
#define MASK_WORDS (KVA_NUMA_MAX_NODES / LONG_BITS)

static int has_node(const unsigned long *mask, unsigned node) {
    return (mask[node / LONG_BITS] >> (node % LONG_BITS)) & 1;
}

/* The nodes of mask as ranges ("0-3,6"), cut short with "..." if out is too small. */
static void format_nodes(const unsigned long *mask, char *out, size_t len) {
    size_t used = 0;
    out[0] = '\0';
    for (unsigned node = 0; node < KVA_NUMA_MAX_NODES; node++) {
        if (!has_node(mask, node)) continue;
        unsigned last = node;
        while (last + 1 < KVA_NUMA_MAX_NODES && has_node(mask, last + 1)) last++;
        int n = last > node ? snprintf(out + used, len - used, "%s%u-%u", used ? "," : "", node, last)
                            : snprintf(out + used, len - used, "%s%u", used ? "," : "", node);
        if (n < 0 || (size_t)n >= len - used) {
            snprintf(out + (len > 4 ? len - 4 : 0), len > 4 ? 4 : len, "...");
            return;
        }
        used += (size_t)n;
        node = last;
    }
    if (used == 0) snprintf(out, len, "none");
}

kva_status kva_numa_check_node(int node) {
    if (node < 0 || node >= KVA_NUMA_MAX_NODES)
        return kva_fail(KVA_ERR_INVALID, "numa_node %d does not exist (node ids lie in 0..%d)", node,
                        KVA_NUMA_MAX_NODES - 1);
    unsigned long allowed[MASK_WORDS];
    memset(allowed, 0, sizeof allowed);
    kva_status st = kva_os_get_mempolicy(NULL, allowed, KVA_NUMA_MAX_NODES, NULL, MPOL_F_MEMS_ALLOWED);
    if (st != KVA_OK) return st;
    if (has_node(allowed, (unsigned)node)) return KVA_OK;
    char nodes[64], path[64];
    format_nodes(allowed, nodes, sizeof nodes);
    snprintf(path, sizeof path, "/sys/devices/system/node/node%d", node);
    if (kva_os_path_exists(path))
        return kva_fail(KVA_ERR_INVALID, "numa_node %d is outside this process's cpuset (it may use nodes %s)", node,
                        nodes);
    return kva_fail(KVA_ERR_INVALID, "numa_node %d does not exist (this process may use nodes %s)", node, nodes);
}

static int force_arenas;

void kva_numa_test_force_arenas(int force) { __atomic_store_n(&force_arenas, force, __ATOMIC_RELAXED); }

static unsigned allowed_nodes(unsigned long *allowed) {
    memset(allowed, 0, MASK_WORDS * sizeof *allowed);
    if (kva_os_get_mempolicy(NULL, allowed, KVA_NUMA_MAX_NODES, NULL, MPOL_F_MEMS_ALLOWED) != KVA_OK) return 0;
    unsigned count = 0;
    for (unsigned w = 0; w < MASK_WORDS; w++) count += (unsigned)__builtin_popcountl(allowed[w]);
    return count;
}

unsigned kva_numa_allowed_count(void) {
    unsigned long allowed[MASK_WORDS];
    return allowed_nodes(allowed);
}

int kva_numa_arenas_wanted(void) {
    return __atomic_load_n(&force_arenas, __ATOMIC_RELAXED) || kva_numa_allowed_count() > 1;
}

int kva_numa_node_of_cpu(unsigned cpu) {
    unsigned long allowed[MASK_WORDS];
    if (allowed_nodes(allowed) == 0) return -1;
    int first = -1;
    /* sysfs links cpuN to its node as a directory entry nodeK. */
    for (unsigned node = 0; node < KVA_NUMA_MAX_NODES; node++) {
        if (!has_node(allowed, node)) continue;
        if (first < 0) first = (int)node;
        char path[96];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%u/node%u", cpu, node);
        if (!__atomic_load_n(&force_arenas, __ATOMIC_RELAXED) && kva_os_path_exists(path)) return (int)node;
    }
    return __atomic_load_n(&force_arenas, __ATOMIC_RELAXED) ? first : -1;
}

kva_status kva_numa_bind(void *addr, size_t length, int node, kva_numa_policy policy) {
    unsigned long mask[MASK_WORDS];
    memset(mask, 0, sizeof mask);
    mask[(unsigned)node / LONG_BITS] = 1ul << ((unsigned)node % LONG_BITS);
    unsigned long words = (unsigned long)node / LONG_BITS + 1;
    int mode = policy == KVA_NUMA_PREFERRED ? MPOL_PREFERRED : MPOL_BIND;
    /* The kernel reads maxnode - 1 bits of the mask (an off-by-one kept for compatibility). */
    kva_status st = kva_os_mbind(addr, length, mode, mask, words * LONG_BITS + 1);
    if (st == KVA_OK) return KVA_OK;
    char why[192];
    snprintf(why, sizeof why, "%s", kva_last_error());
    return kva_fail(st, "binding the region to NUMA node %d (%s): %s", node,
                    policy == KVA_NUMA_PREFERRED ? "preferred" : "bind", why);
}
